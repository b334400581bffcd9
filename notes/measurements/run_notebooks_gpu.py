"""Run notebooks' code cells in order as scripts on a machine without Jupyter (the GPU machine): each
notebook in a fresh interpreter, from its own folder, matplotlib on Agg; one JSON line per notebook."""
import json
import subprocess
import sys
import time
from pathlib import Path

RUNNER = r'''
import json, os, sys
os.environ.setdefault("MPLBACKEND", "Agg")
nb = json.load(open(sys.argv[1]))
os.chdir(os.path.dirname(os.path.abspath(sys.argv[1])))
sys.path.insert(0, os.getcwd())
g = {"__name__": "__main__"}
for i, cell in enumerate(nb["cells"]):
    if cell["cell_type"] != "code":
        continue
    src = "".join(cell["source"])
    src = "\n".join(l for l in src.splitlines() if not l.lstrip().startswith(("%", "!")))
    try:
        exec(compile(src, f"{sys.argv[1]}#cell{i}", "exec"), g)
    except SystemExit:
        pass
    except Exception:
        import traceback; traceback.print_exc(); print(f"FAILED at cell {i}"); sys.exit(1)
'''

for path in sys.argv[1:]:
    t = time.time()
    try:
        proc = subprocess.run([sys.executable, "-c", RUNNER, path], capture_output=True, text=True, timeout=150)
        ok, tail = proc.returncode == 0, (proc.stdout + proc.stderr)[-1500:]
    except subprocess.TimeoutExpired as e:
        ok, tail = False, f"timed out after 150 s: {str(e.stdout)[-500:]}"
    print(json.dumps({"notebook": path, "ok": ok, "seconds": round(time.time() - t, 1),
                      **({} if ok else {"tail": tail})}), flush=True)
