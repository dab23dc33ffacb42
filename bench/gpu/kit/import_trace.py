"""Import modules from a pip --target folder and list what came from it (the kit's wheel choice).

    python3 bench/gpu/kit/import_trace.py SITE module[,module...]   (PYTHONPATH=SITE:repo)

Prints JSON: `failed` (module -> error) and `tops`, the top-level packages under SITE that the
imports loaded. A wheel whose top-level packages are not among them is not needed by those
imports; rehearse.sh requires `failed` to be empty.
"""

import importlib
import json
import os
import sys


def main() -> None:
    site, modules = sys.argv[1], sys.argv[2].split(",")
    failed = {}
    for module in modules:
        try:
            importlib.import_module(module)
        except BaseException as error:  # a module's own SystemExit or ImportError is the finding
            failed[module] = f"{type(error).__name__}: {error}"[:300]
    tops = set()
    for loaded in list(sys.modules.values()):
        path = getattr(loaded, "__file__", None) or ""
        if path.startswith(site):
            tops.add(os.path.relpath(path, site).split(os.sep)[0])
    print(json.dumps({"failed": failed, "tops": sorted(tops)}, indent=1))


if __name__ == "__main__":
    main()
