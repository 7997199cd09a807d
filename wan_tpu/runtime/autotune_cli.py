"""`wan-autotune-packs` (`python -m wan_tpu.runtime.autotune_cli`): make and list the GPU autotuning packs
(`wan_tpu.runtime.autotune_packs`).

    wan-autotune-packs export CACHE_DIR [CACHE_DIR ...] [--out DIR]   # cold runs' results → the packs of their names
    wan-autotune-packs list                                           # the packs shipped, with their result counts
"""

from __future__ import annotations

import os

from wan_tpu.errors import WanInputError
from wan_tpu.runtime import autotune_packs
from wan_tpu.runtime.cli import CliParser, run_cli


def build_parser() -> CliParser:
    p = CliParser(prog="wan-autotune-packs", description="GPU autotuning results shipped per jax/jaxlib/device kind")
    sub = p.add_subparsers(dest="what", required=True)
    e = sub.add_parser("export", help="merge the per-fusion autotuning results of cache folders into packs")
    e.add_argument("cache_dirs", nargs="+", metavar="CACHE_DIR", help="the WAN_TPU_CACHE_DIR of a cold GPU run")
    e.add_argument("--out", default=None, help="where the packs go (default: the package's, wan_tpu/runtime/autotune)")
    sub.add_parser("list", help="the packs shipped, with their result counts")
    return p


def run(args) -> None:
    if args.what == "list":
        for version in autotune_packs.shipped():
            try:
                print(f"{version}: {len(autotune_packs.read(autotune_packs.pack_path(version))['files'])} results")
            except ValueError as e:
                raise WanInputError(f"{e}; reinstall the package") from None
        return
    missing = [d for d in args.cache_dirs if not os.path.isdir(d)]
    if missing:
        raise WanInputError(f"{missing[0]} is not a folder; give the WAN_TPU_CACHE_DIR of a cold run")
    try:
        written = autotune_packs.export(args.cache_dirs, args.out)
    except ValueError as e:  # the pack to merge into
        raise WanInputError(f"{e}; remove it or choose another --out") from None
    if not written:
        raise WanInputError(f"no {autotune_packs.FOLDER} in {', '.join(args.cache_dirs)} (only GPU runs write "
                            "autotuning results)")
    for path, count in written.items():
        print(f"wrote {path}: {count} results")


def main(argv=None) -> int:
    return run_cli(run, build_parser(), argv)


if __name__ == "__main__":
    from wan_tpu.commands import autotune_packs as command

    command()
