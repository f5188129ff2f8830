"""Moved: ``python -m jaxpt.compile`` is ``python -m jaxpt.tools.compile`` (this alias goes in the next release)."""

if __name__ == "__main__":
    from jaxpt.tools import run_moved
    run_moved("jaxpt.compile", "jaxpt.tools.compile")
