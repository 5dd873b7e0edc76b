"""Incremental detokenisation with the real SmolLM2 tokenizer, and stop-string handling.

The detokenizer must emit, token by token, exactly the text a full decode gives, never a
U+FFFD for a character split over tokens (byte-level BPE splits emoji, CJK and rare
letters into byte pieces). The StopChecker must never leak a stop string, even split
over deltas, and never lose held-back text.
"""

import random

import pytest

from jaxserve.tokenization.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

TEXTS = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog.",
    "emoji": "Llamas 🦙 to the moon 🚀, family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵!",
    "cjk": "日本語のテキストと中文字符，还有한국어도 있어요。",
    "accents": "café naïve résumé Ελληνικά Ωμέγα Ångström żółć",
    "byte_fallback": "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝛼𝛽𝛾 rare CJK 𠀋𡈽𪚲 and ᚠᛇᚻ runes",
    "whitespace": "tabs\tand\nnew lines\n\n  double  spaces   end ",
}
SPLIT_PRONE = ("emoji", "cjk", "byte_fallback")


@pytest.fixture(scope="module")
def tok(smollm2_checkpoint):
    return Tokenizer.from_dir(smollm2_checkpoint)


@pytest.fixture(scope="module")
def chat_prompt(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    return tok.encode(text, add_special_tokens=False)


def stream(tok, prompt, ids, chunk=1, skip_special_tokens=True):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    return [d.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_one_token_at_a_time_matches_full_decode(tok, chat_prompt, name):
    text = TEXTS[name]
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, chat_prompt, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas), deltas
    if name in SPLIT_PRONE:
        # The test exercises the hard case: some tokens alone are partial characters.
        assert any("\ufffd" in tok.decode([t]) for t in ids)
        assert "" in deltas  # ...and the detokenizer held them back


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_several_ids_per_add(tok, chat_prompt, chunk):
    text = TEXTS["emoji"] + TEXTS["cjk"]
    ids = tok.encode(text, add_special_tokens=False)
    deltas = stream(tok, chat_prompt, ids, chunk=chunk)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_empty_and_short_prompts(tok):
    ids = tok.encode(TEXTS["accents"], add_special_tokens=False)
    for prompt in ([], ids[:1], tok.encode("Hi", add_special_tokens=False)):
        assert "".join(stream(tok, prompt, ids)) == TEXTS["accents"]


def test_incomplete_character_at_end_is_held_back(tok):
    ids = tok.encode("ok 🦙", add_special_tokens=False)
    partial = ids[:-1]  # the llama's last byte piece is missing
    assert tok.decode(partial).endswith("\ufffd")
    deltas = stream(tok, [], partial)
    assert "".join(deltas) == "ok"  # " " + incomplete char wait for the next token
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("Hello", add_special_tokens=False) + [tok.eos_token_id] + \
        tok.encode(" there", add_special_tokens=False)
    assert "".join(stream(tok, [], ids)) == "Hello there"
    assert "".join(stream(tok, [], ids, skip_special_tokens=False)) == "Hello<|im_end|> there"


def test_long_output_window_stays_small(tok):
    ids = tok.encode(TEXTS["ascii"] * 20, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [])
    out = "".join(d.add([t]) for t in ids)
    assert out == TEXTS["ascii"] * 20
    assert len(d._ids) <= 4  # only the last few ids are re-decoded each step


# -- StopChecker --------------------------------------------------------------------------

def feed_all(checker, deltas):
    out, stopped = [], False
    for d in deltas:
        text, stopped = checker.feed(d)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(checker.flush())
    return "".join(out), stopped, out


def test_stop_string_split_across_deltas():
    c = StopChecker(["STOP"])
    assert c.feed("abc S") == ("abc ", False)
    assert c.held_back == "S"
    assert c.feed("T") == ("", False)
    assert c.feed("OP and more") == ("", True)
    assert c.feed("later") == ("", True)


def test_false_start_is_released():
    c = StopChecker(["STOP"])
    assert c.feed("ST") == ("", False)
    assert c.feed("ART") == ("START", False)


def test_multiple_stop_strings_earliest_wins():
    assert feed_all(StopChecker(["END", "\n\n"]), ["x", " E", "ND y\n", "\n"])[:2] == ("x ", True)
    assert feed_all(StopChecker(["END", "\n\n"]), ["x\n", "\nEND"])[:2] == ("x", True)
    # a held prefix of one stop string turns out to contain another
    c = StopChecker(["abcd", "bx"])
    assert c.feed("zab") == ("z", False)
    assert c.feed("x!") == ("a", True)


def test_stop_at_the_very_start():
    assert StopChecker(["<stop>"]).feed("<stop> trailing") == ("", True)
    c = StopChecker(["<stop>"])
    assert c.feed("<st") == ("", False)
    assert c.feed("op>") == ("", True)


def test_flush_releases_held_text_without_false_holdback():
    c = StopChecker(["STOP"])
    assert c.feed("hello S") == ("hello ", False)
    assert c.flush() == "S"
    assert c.flush() == ""
    assert c.feed("more") == ("", True)


def test_include_stop_str_in_output():
    c = StopChecker(["STOP"], include_stop_str_in_output=True)
    assert c.feed("ab ST") == ("ab ", False)
    assert c.feed("OPcd") == ("STOP", True)


def test_no_stop_strings_passes_through():
    c = StopChecker([])
    assert c.feed("anything") == ("anything", False)
    assert c.flush() == ""


@pytest.mark.parametrize("include", [False, True])
def test_random_splits_match_reference(include):
    rng = random.Random(0)
    stops = ["aba", "cc", "abcab"]
    for _ in range(500):
        full = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(full) + 1), min(len(full) + 1, rng.randint(0, 8))))
        deltas = [full[i:j] for i, j in zip([0] + cuts, cuts + [len(full)])]
        text, stopped, _ = feed_all(StopChecker(stops, include), deltas)
        hits = [(full.find(s), -len(s), s) for s in stops if s in full]
        if hits:
            i, _, s = min(hits)
            assert stopped and text == (full[:i + len(s)] if include else full[:i])
        else:
            assert not stopped and text == full
