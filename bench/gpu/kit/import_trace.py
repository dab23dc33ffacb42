"""Import the modules an SGLang-through-verl genrun run loads, and list the distributions they come from."""
import importlib, sys, os, json, traceback
site = sys.argv[1]
mods = sys.argv[2].split(",")
failed = {}
for m in mods:
    try:
        importlib.import_module(m)
    except BaseException as e:
        failed[m] = f"{type(e).__name__}: {e}"[:300]
# map module files under site to top-level names
tops = set()
for name, mod in list(sys.modules.items()):
    f = getattr(mod, "__file__", None) or ""
    if f.startswith(site):
        tops.add(os.path.relpath(f, site).split(os.sep)[0])
print(json.dumps({"failed": failed, "tops": sorted(tops)}, indent=1))
