from weaver.sim.engine import Engine


def test_events_run_in_time_then_id_order():
    engine = Engine()
    order = []
    for name, t in [("late", 2.0), ("first-at-1", 1.0), ("second-at-1", 1.0)]:
        engine.schedule(t, name, lambda now, name=name: order.append((name, now)))
    engine.run()
    assert order == [("first-at-1", 1.0), ("second-at-1", 1.0), ("late", 2.0)]


def test_actions_return_follow_up_events():
    engine = Engine()
    seen = []

    def tick(now):
        seen.append(now)
        if len(seen) < 3:
            return [engine.event(now + 0.5, "tick", tick)]
        return None

    engine.schedule(0.0, "tick", tick)
    assert engine.run() == 1.0
    assert seen == [0.0, 0.5, 1.0]
    assert engine.num_processed == 3


def test_follow_up_at_same_time_runs_after_already_queued_events():
    engine = Engine()
    order = []

    def a(now):
        order.append("a")
        return [engine.event(now, "c", lambda t: order.append("c"))]

    engine.schedule(1.0, "a", a)
    engine.schedule(1.0, "b", lambda t: order.append("b"))
    engine.run()
    assert order == ["a", "b", "c"]


def test_run_stops_at_horizon_and_refuses_the_past():
    engine = Engine()
    engine.schedule(5.0, "x", lambda t: None)
    engine.schedule(1.0, "y", lambda t: None)
    engine.run(until=2.0)
    assert engine.now == 1.0 and engine.num_pending == 1
    try:
        engine.event(0.5, "past", lambda t: None)
    except ValueError as exc:
        assert "before now" in str(exc)
    else:
        raise AssertionError("an event in the past must be refused")
