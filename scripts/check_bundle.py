"""Import every `areno` module (and the benchmarks' entry points) with what this Python has: on
the GPU machine, the offline bundle plus the machine's own packages. Prints each module that fails
with its error and exits 1 if any does; the optional trackers (wandb, mlflow) are reported apart,
since `run.loggers` names them only when they are installed.

    PYTHONPATH=$PWD/site:$PWD python3 scripts/check_bundle.py
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback

OPTIONAL = ("wandb", "mlflow")


def modules() -> list[str]:
    import areno

    names = ["areno"]
    for info in pkgutil.walk_packages(areno.__path__, prefix="areno."):
        names.append(info.name)
    return sorted(names)


def main() -> int:
    failed: dict[str, str] = {}
    names = modules()
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # every failure is reported, none stops the check
            failed[name] = "".join(traceback.format_exception_only(error)).strip()
    optional = {}
    for name in OPTIONAL:
        try:
            importlib.import_module(name)
            optional[name] = "installed"
        except ImportError:
            optional[name] = "absent (run.loggers cannot name it)"
    print(f"{len(names) - len(failed)} of {len(names)} areno modules import")
    for name, error in failed.items():
        print(f"  FAILED {name}: {error}")
    for name, state in optional.items():
        print(f"  optional {name}: {state}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
