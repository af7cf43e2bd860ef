"""`python -m jax_sparse_mla demo [--config tiny|deepseek_v32] [--kernels auto|xla|pallas]`"""

import argparse
import sys

from .demo import run_demo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_sparse_mla")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="serve a small synthetic workload and check it against the reference")
    demo.add_argument("--config", choices=["tiny", "deepseek_v32"], default=None,
                      help="default: tiny on CPU, deepseek_v32 on a GPU")
    demo.add_argument("--kernels", choices=["auto", "xla", "pallas"], default="auto")
    args = parser.parse_args(argv)
    return run_demo(args.config, args.kernels)


if __name__ == "__main__":
    sys.exit(main())
