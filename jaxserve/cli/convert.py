"""`jaxserve convert`: an HF model directory or a GGUF file into a jaxserve checkpoint.

    jaxserve convert SRC OUT [--dtype float32|bfloat16]
                             [--quantization gguf|gptq|awq|compressed-tensors|int8|int4]

SRC: an HF directory (config.json, *.safetensors, tokenizer.json) or a .gguf file.
OUT: the checkpoint directory to write (an existing checkpoint there is replaced).
--quantization gguf keeps a GGUF file's Q4_0 / Q4_1 / Q8_0 matrices in their blocks
(served as they are: `jaxserve serve --model OUT`); otherwise they are dequantised.
A GPTQ, AWQ or compressed-tensors (pack-quantized) HF directory keeps its int4 / int8
codes as GGML blocks whether or not --quantization names its method (which must match).
--quantization int8 / int4 quantises a float source's matrices into llama.cpp's Q8_0 /
Q4_1 blocks (the embedding and LM head Q8_0 under int4 too).
Exits 1 with a one-line error if the source cannot be converted.
"""

import argparse
import logging
import sys

from jaxserve.checkpoint import CheckpointError, convert
from jaxserve.checkpoint.convert import CONVERT_QUANTIZATIONS


def main(argv=None, prog: str = "jaxserve convert") -> int:
    """Run the CLI on `argv` (default sys.argv[1:]); returns the exit code (0 ok, 1 error)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="HF model directory or GGUF file")
    ap.add_argument("out", help="checkpoint directory to write")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                    help="param dtype (default: the source's; quantised GGUF -> float32)")
    ap.add_argument("--quantization", "-q", choices=CONVERT_QUANTIZATIONS[1:], default=None,
                    help="gguf: keep a GGUF file's block-quantised matrices as they are; "
                         "gptq / awq / compressed-tensors: the HF directory's method "
                         "(detected when not given); int8 / int4: quantise the matrices "
                         "into Q8_0 / Q4_1 blocks")
    ap.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    args = ap.parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("jaxserve").addHandler(handler)
    logging.getLogger("jaxserve").setLevel(logging.WARNING if args.quiet else logging.INFO)
    logging.getLogger("jaxserve").propagate = False
    try:
        out = convert(args.src, args.out, dtype=args.dtype, progress=not args.quiet,
                      quantization=args.quantization)
    except (CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
