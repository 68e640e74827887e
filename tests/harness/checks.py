"""What the Python tests share: named checks that are counted, not fatal, and
running the meshtrain executable."""
import subprocess
import sys


class Checks:
    def __init__(self, meshtrain):
        self.meshtrain_path = meshtrain
        self.failures = []

    def check(self, ok, what):
        print(("ok: " if ok else "FAIL: ") + what, flush=True)
        if not ok:
            self.failures.append(what)

    def meshtrain(self, *args):
        """Runs meshtrain; its stdout, or RuntimeError with its stderr when it fails."""
        out = subprocess.run([self.meshtrain_path, *args], capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"meshtrain {' '.join(args)} failed:\n{out.stderr}")
        return out.stdout

    def finish(self):
        print(f"{len(self.failures)} failure(s)")
        sys.exit(1 if self.failures else 0)
