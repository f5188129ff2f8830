"""Moved: ``python -m jaxpt.gate`` is ``python -m jaxpt.tools.gate`` (this alias goes in the next release)."""

if __name__ == "__main__":
    from jaxpt.tools import run_moved
    run_moved("jaxpt.gate", "jaxpt.tools.gate")
