"""`python -m jax_sparse_mla [--version] demo [--config tiny|deepseek_v32] [--kernels auto|xla|pallas] [--force]`

Arguments are parsed before anything heavy is imported: `--help` and `--version` never import
jax; the demo (and with it jax) is imported only once a demo is requested.
"""

import argparse
import sys

from . import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jax_sparse_mla",
                                     description="DeepSeek-V3.2 sparse MLA attention (DSA) for JAX.")
    parser.add_argument("--version", action="version", version=f"jax_sparse_mla {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="command")
    demo = sub.add_parser("demo", help="serve a small synthetic workload and check every step against the reference")
    demo.add_argument("--config", choices=["tiny", "deepseek_v32"], default=None,
                      help="default: tiny on CPU, deepseek_v32 on a GPU")
    demo.add_argument("--kernels", choices=["auto", "xla", "pallas"], default="auto")
    demo.add_argument("--force", action="store_true",
                      help="run --config deepseek_v32 even on a CPU backend (hours: about 8 minutes a step)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .serving.demo import run_demo  # imports jax

    return run_demo(args.config, args.kernels, force=args.force)


if __name__ == "__main__":
    sys.exit(main())
