"""Moved: ``python -m jaxpt.evaluate`` is ``python -m jaxpt.tools.evaluate``, and its ``--lengths`` form (the
length-extrapolation report) is ``python -m jaxpt.tools.evaluate extrapolation`` (this alias goes in the next
release)."""

if __name__ == "__main__":
    import sys

    from jaxpt.tools import run_moved
    lengths = any(a == "--lengths" or a.startswith("--lengths=") for a in sys.argv[1:])
    run_moved("jaxpt.evaluate", "jaxpt.tools.evaluate", *(["extrapolation"] if lengths else []))
