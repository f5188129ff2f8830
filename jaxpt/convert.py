"""Moved: ``python -m jaxpt.convert`` is ``python -m jaxpt.tools.convert`` (this alias goes in the next release)."""

if __name__ == "__main__":
    from jaxpt.tools import run_moved
    run_moved("jaxpt.convert", "jaxpt.tools.convert")
