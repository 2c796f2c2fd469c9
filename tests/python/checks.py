"""What every end-to-end check script shares: a named check that stops the script at the first
failure, a check that a call raises a given exception class, and the closing count the Rust
side prints. Imported by the scripts beside it (Python puts a script's own folder on its path).
"""

import sys

passed = 0


def check(name, cond, detail=""):
    global passed
    if not cond:
        print(f"FAIL {name}: {detail}")
        sys.exit(1)
    passed += 1
    print(f"ok   {name}")


def raises(name, cls, fn):
    """Check that `fn()` raises `cls`; the exception, for further checks."""
    try:
        fn()
    except cls as e:
        check(name, True)
        return e
    except Exception as e:  # noqa: BLE001 - the wrong class is the failure reported
        check(name, False, f"raised {type(e).__name__}: {e}")
    check(name, False, "did not raise")


def done():
    print(f"{passed} passed, 0 failed")
