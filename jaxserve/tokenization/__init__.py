"""Text in and out: the tokenizer (HF `tokenizers`), incremental detokenisation and stop
strings, chat templates (jinja2, as transformers renders them).

May import: third-party libraries only (it sits below everything else in jaxserve).
"""
