"""StepTime: the measured cost of a step per computed token (shared steps' length); IdleTime:
the seconds the engine sat between steps."""

from runtime.scheduler.step_time import IdleTime, StepTime


def test_the_fit_finds_a_steps_fixed_cost_and_its_cost_per_token():
    step_time = StepTime()
    for tokens in (1, 1, 1, 1, 1, 1):  # decode steps alone: no slope to fit
        step_time.observe(tokens, 0.040 + 0.002 * tokens)
    assert step_time.fit() is None and step_time.tokens_within(0.08) is None
    for tokens in (64, 1, 30, 1, 64, 2):
        step_time.observe(tokens, 0.040 + 0.002 * tokens)
    t0, per_token_s = step_time.fit()
    assert abs(t0 - 0.040) < 1e-6 and abs(per_token_s - 0.002) < 1e-8
    assert step_time.tokens_within(0.080) in (19, 20)
    assert step_time.tokens_within(0.030) == 0  # the fixed cost alone is over


def test_the_fit_follows_the_machine_when_steps_get_slower():
    step_time = StepTime()
    for tokens in (1, 64, 1, 32) * 10:
        step_time.observe(tokens, 0.001 + 0.0001 * tokens)
    fast = step_time.tokens_within(0.080)
    for tokens in (1, 64, 1, 32) * 20:  # another process takes the cores: 10x slower
        step_time.observe(tokens, 0.010 + 0.001 * tokens)
    slow = step_time.tokens_within(0.080)
    assert fast > 700 and 60 <= slow <= 75


def test_idle_time_counts_the_gaps_between_steps_not_the_steps():
    now = [0.0]
    idle = IdleTime()
    idle.clock = lambda: now[0]
    assert idle.total_s() == 0.0  # no step seen yet
    for start_s, end_s in ((1.0, 1.5), (3.0, 3.25), (3.25, 4.0)):
        now[0] = start_s
        idle.step_started()
        now[0] = end_s
        idle.step_ended()
    assert idle.total_s() == 1.5  # 1.5 -> 3.0; back to back after that
    now[0] = 6.0
    assert idle.total_s() == 3.5  # the gap since the last step counts while it lasts
