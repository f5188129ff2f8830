"""Extraction: an HTML document's main text (trafilatura), each page within `AdmissionConfig.extraction_seconds`."""

from __future__ import annotations

import threading

import apache_beam as beam

from data_pipelines import readers
from data_pipelines.steps import admission, base


REASONS = ("extraction_empty", "extraction_timeout")

# The worker process budgeted extraction runs in, one per calling thread (Beam's multi-threaded direct runner would
# otherwise queue one thread's page behind another's and count the wait in its budget); made on first use,
# replaced after a timeout.
_EXTRACTORS = threading.local()


def _trafilatura_main_text(html: str) -> str | None:
    import logging

    import trafilatura

    # trafilatura logs an ERROR line for every page it finds no tree or text in; each such page is counted as an
    # extraction_empty drop, so the lines (three per page, 46,000 for a file of 15,000 plain-text lines) say nothing
    logging.getLogger("trafilatura").setLevel(logging.CRITICAL)

    return trafilatura.extract(html, include_comments=False, include_tables=True, deduplicate=False)


_EXTRACTOR_START_SECONDS = 600.0  # how long a new worker may take to start and import trafilatura


def _extractor_ready() -> bool:
    import trafilatura  # the worker's import and first-call set-up, done before any page's budget starts

    trafilatura.extract("<html><body><p>ready</p></body></html>")
    return True


def _extractor():
    """The extraction worker, started and ready: its start-up (a spawned interpreter importing trafilatura, seconds
    on a loaded host) is never counted in a page's budget.

    Raises:
      RuntimeError: the worker did not start within ``_EXTRACTOR_START_SECONDS``.
    """
    import multiprocessing

    pool = getattr(_EXTRACTORS, "pool", None)
    if pool is None:
        pool = multiprocessing.get_context("spawn").Pool(1)
        try:
            pool.apply_async(_extractor_ready).get(_EXTRACTOR_START_SECONDS)
        except multiprocessing.TimeoutError:
            pool.terminate()
            raise RuntimeError(f"the main-text extraction worker did not start in {_EXTRACTOR_START_SECONDS:g} s "
                               "(AdmissionConfig.extraction_seconds > 0 runs extraction in a worker)") from None
        _EXTRACTORS.pool = pool
    return pool


def _main_text_within(html: str, seconds: float) -> str | None:
    """trafilatura's main text of ``html``, computed in a worker process that is killed after ``seconds`` of this
    page's extraction (the worker's start-up is not counted).

    Raises:
      TimeoutError: the extraction ran past ``seconds`` (the worker was terminated; the next call starts one).
    """
    import multiprocessing

    pool = _extractor()
    try:
        return pool.apply_async(_trafilatura_main_text, (html,)).get(seconds)
    except multiprocessing.TimeoutError:
        pool.terminate()
        _EXTRACTORS.pool = None
        raise TimeoutError(f"main-text extraction ran past {seconds:g} s") from None


def extract_main_text(doc: dict, seconds: float = 0.0) -> dict:
    """Replaces HTML by its main text (trafilatura: navigation, headers, footers removed); an
    empty result becomes an ``extraction_empty`` drop.

    ``seconds``: the time budget of one page (`AdmissionConfig.extraction_seconds`); above 0 the extraction runs
    in a worker process that is killed when the budget is spent, and the page is an ``extraction_timeout`` drop
    (HTML within the size cap can still take the extractor minutes). 0: in this process, unbounded.
    """
    if not doc.get("html"):
        return doc
    src = {"name": doc["source"], "domain": doc["domain"]}
    if seconds > 0:
        try:
            text = _main_text_within(doc["text"], seconds)
        except TimeoutError as e:
            return readers.drop(doc["id"], src, "admission", "extraction_timeout", f"{e}: {doc['text'][:200]!r}")
    else:
        text = _trafilatura_main_text(doc["text"])
    if not text or not text.strip():
        return readers.drop(doc["id"], src, "admission", "extraction_empty", doc["text"])
    return dict(doc, text=text, html=False)


def _extract(doc: dict, seconds: float):
    doc = extract_main_text(doc, seconds)
    if "verdict" in doc:
        yield beam.pvalue.TaggedOutput(base.DROPS, doc)
    else:
        yield doc


class Extraction(base.Step):
    """HTML to main text; its drops are stage ``admission``'s."""

    name = "extraction"
    stage = config_field = "admission"
    config = admission.AdmissionConfig
    reasons = REASONS

    def expand(self, docs, ctx: base.Context):
        return base.with_drops(docs, "Extract", beam.FlatMap(_extract, ctx.cfg.admission.extraction_seconds), ctx)
