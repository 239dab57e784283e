"""Timing a step's sections (align.observability.timing): seconds added to the store with or without tracing, each
block a span named after its key while tracing is active (its exception recorded on the span), spans of work timed
elsewhere, and no opentelemetry import for the timer alone."""

import subprocess
import sys

from align.observability import Timer, timing


def test_the_timer_does_not_import_opentelemetry():
    code = (
        "import sys, align.observability as o\n"
        "timings = {}\n"
        "with o.Timer(timings, 'time/generation_s'): pass\n"
        "assert timings['time/generation_s'] >= 0\n"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], 'opentelemetry imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_timer_without_the_callback_only_adds_seconds():
    timings = {"time/update_s": 1.0}
    with Timer(timings, "time/update_s") as t:
        pass
    assert t.span is None and timings["time/update_s"] >= 1.0
    assert timing.span_name("time/generation_s") == "generation" and timing.span_name("time/scoring_s") == "scoring"


class Recording:
    """A stand-in for the tracing callback: records what the timer asks of it."""

    def __init__(self):
        self.calls = []

    def open_span(self, name):
        calls = self.calls

        class Span:
            def __exit__(self, *exc):
                calls.append(("exit", name, exc[0]))

        calls.append(("open", name))
        return Span()

    def annotate(self, attributes):
        self.calls.append(("annotate", attributes))

    def record_span(self, name, start_ns, end_ns, attributes):
        self.calls.append(("record", name, start_ns, end_ns, attributes))


def test_span_names_drop_the_group_and_the_unit():
    assert timing.span_name("time/weight_sync_s") == "weight_sync"
    assert timing.span_name("rollout/s") == "s"  # the group goes; "s" alone is not the "_s" unit
    assert timing.span_name("time/episodes") == "episodes" and timing.span_name("update_s") == "update"


def test_with_tracing_a_block_is_a_span_that_records_its_exception_and_the_seconds_still_add_up(monkeypatch):
    tracing = Recording()
    monkeypatch.setattr(timing, "_active", tracing)
    timings = {}
    with Timer(timings, "time/generation_s") as t:
        t.annotate({"align.rows": 8})
    try:
        with Timer(timings, "time/generation_s"):
            raise ValueError("reward exploded")
    except ValueError:
        pass
    timing.record_span("env.step", 10, 20, {"turn": 1})
    assert tracing.calls == [
        ("open", "generation"),
        ("annotate", {"align.rows": 8}),
        ("exit", "generation", None),
        ("open", "generation"),
        ("exit", "generation", ValueError),  # the span sees the exception, which still propagates
        ("record", "env.step", 10, 20, {"turn": 1}),
    ]
    assert set(timings) == {"time/generation_s"} and timings["time/generation_s"] >= 0


def test_installing_and_removing_tracing(monkeypatch):
    monkeypatch.setattr(timing, "_active", None)
    tracing = Recording()
    timing._install(tracing)
    with Timer({}, "time/scoring_s"):
        pass
    timing._install(None)
    with Timer({}, "time/scoring_s") as t:
        t.annotate({"ignored": True})  # nothing to annotate without tracing
    timing.record_span("ignored", 0, 1, {})
    assert tracing.calls == [("open", "scoring"), ("exit", "scoring", None)]
