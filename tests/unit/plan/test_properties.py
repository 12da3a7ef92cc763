"""Planner properties (hypothesis): every plan is valid, and any layout that fits is found."""

from functools import cache

from hypothesis import given, settings
from hypothesis import strategies as st

from epd_kit import plan as planner

TPS = st.sampled_from([1, 2, 4, 8, 16])


def make_settings(ve_tp, pd_tp):
    return planner.read_settings({"epd_model": "/models/m", "epd_ve_tp": ve_tp, "epd_ve_dp": 1, "epd_pd_tp": pd_tp})


@st.composite
def hosts(draw, max_cores, tps=TPS):
    """A random host: core budget, excluded and faulted sets, engine counts, TPs."""
    ve_tp, pd_tp = draw(tps), draw(tps)
    core_count = draw(st.integers(min(ve_tp, pd_tp), max_cores))
    # few holes, so that many cases are tight but still fit
    excluded = draw(st.frozensets(st.integers(0, core_count - 1), max_size=max(1, core_count // 8)))
    faulted = draw(st.frozensets(st.integers(0, max_cores + 8), max_size=4))  # may lie beyond the budget
    capacity = core_count // min(ve_tp, pd_tp)
    num_ve = draw(st.integers(0, min(6, capacity)))
    num_pd = draw(st.integers(0 if num_ve else 1, min(6, capacity)))
    host = planner.HostSpec(
        name="n1", num_ve=num_ve, num_pd=num_pd, core_count=core_count, excluded_cores=excluded, faulted_cores=faulted
    )
    return host, make_settings(ve_tp, pd_tp)


def brute_force_fits(core_count, blocked, ve_tp, pd_tp, num_ve, num_pd):
    """Exhaustive search over aligned slices (independent of the planner's greedy order)."""
    free_mask = 0
    for core in range(core_count):
        if core not in blocked:
            free_mask |= 1 << core

    def slots(tp):
        block = (1 << tp) - 1
        return [block << s for s in range(0, core_count - tp + 1, tp) if (block << s) & free_mask == block << s]

    ve_slots, pd_slots = slots(ve_tp), slots(pd_tp)

    @cache
    def search(used, ve_left, pd_left, ve_from, pd_from):
        if pd_left:
            return any(
                not (used & slot) and search(used | slot, ve_left, pd_left - 1, ve_from, i + 1)
                for i, slot in enumerate(pd_slots[pd_from:], pd_from)
            )
        if ve_left:
            return any(
                not (used & slot) and search(used | slot, ve_left - 1, 0, i + 1, 0)
                for i, slot in enumerate(ve_slots[ve_from:], ve_from)
            )
        return True

    return search(0, num_ve, num_pd, 0, 0)


def assert_valid(plan, host, settings):
    used = {}
    for engine in plan["n1"]["engines"]:
        tp = settings.tp(engine["role"])
        cores = engine["cores"]
        assert cores == list(range(cores[0], cores[0] + tp)), "contiguous, tp wide"
        assert cores[0] % tp == 0, "aligned to its own TP"
        assert cores[-1] < host.core_count, "within the budget"
        assert not set(cores) & host.blocked, "no excluded or faulted core"
        assert engine["env"]["NEURON_VISIBLE_DEVICES"] == ",".join(map(str, cores))
        assert engine["argv"][engine["argv"].index("--tensor-parallel-size") + 1] == str(len(cores))
        for core in cores:
            assert core not in used, "disjoint"
            used[core] = engine["engine_id"]
    counts = [e["role"] for e in plan["n1"]["engines"]]
    assert (counts.count("ve"), counts.count("pd")) == (host.num_ve, host.num_pd)
    ports = [e["port"] for e in plan["n1"]["engines"]] + [
        p for e in plan["n1"]["engines"] for p in e["side_channel_ports"]
    ]
    assert len(ports) == len(set(ports)) and settings.router_port not in ports


@settings(max_examples=300, deadline=None)
@given(hosts(max_cores=64))
def test_every_plan_is_aligned_disjoint_in_budget_and_avoids_excluded_cores(case):
    host, settings_ = case
    try:
        plan = planner.plan_fleet(settings_, [host])
    except planner.EpdPlanError as error:
        assert "layout does not fit" in str(error)  # noqa: PT017 (hypothesis: some draws must fail)
        assert host.num_ve * settings_.ve_tp + host.num_pd * settings_.pd_tp > 0
        return
    assert_valid(plan, host, settings_)


SMALL_TPS = st.sampled_from([1, 2, 4, 8])


@settings(max_examples=400, deadline=None)
@given(hosts(max_cores=16, tps=SMALL_TPS))
def test_any_layout_that_fits_is_found(case):
    host, settings_ = case
    fits = brute_force_fits(host.core_count, host.blocked, settings_.ve_tp, settings_.pd_tp, host.num_ve, host.num_pd)
    found = planner.place(host, settings_) is not None
    assert found == fits


@settings(max_examples=200, deadline=None)
@given(hosts(max_cores=16, tps=SMALL_TPS))
def test_reported_fits_are_real_and_maximal(case):
    host, settings_ = case
    if planner.place(host, settings_) is not None:
        return
    blocked, ve_tp, pd_tp = host.blocked, settings_.ve_tp, settings_.pd_tp
    for num_ve, num_pd in planner.largest_fits(host, settings_):
        assert brute_force_fits(host.core_count, blocked, ve_tp, pd_tp, num_ve, num_pd)
        if num_ve == host.num_ve and num_pd < host.num_pd:
            assert not brute_force_fits(host.core_count, blocked, ve_tp, pd_tp, num_ve, num_pd + 1)
        if num_pd == host.num_pd and num_ve < host.num_ve:
            assert not brute_force_fits(host.core_count, blocked, ve_tp, pd_tp, num_ve + 1, num_pd)
    message = str(_error(host, settings_))
    assert f"{host.usable_cores} usable cores" in message


def _error(host, settings_):
    try:
        planner.plan_fleet(settings_, [host])
    except planner.EpdPlanError as error:
        return error
    raise AssertionError("expected a layout error")


@settings(max_examples=150, deadline=None)
@given(data=st.data(), ve_tp=TPS, pd_tp=TPS)
def test_hand_pinned_slices_are_kept_and_the_rest_fills_around_them(data, ve_tp, pd_tp):
    settings_ = make_settings(ve_tp, pd_tp)
    core_count = data.draw(st.sampled_from([16, 32, 64]))
    starts = data.draw(st.lists(st.integers(0, core_count // ve_tp - 1), max_size=4, unique=True))
    pinned_ve = tuple(s * ve_tp for s in starts)  # aligned VE slots, disjoint by construction
    num_pd = data.draw(st.integers(0, 4))
    host = planner.HostSpec(
        name="n1", num_ve=len(pinned_ve), num_pd=num_pd, core_count=core_count, slices={"ve": pinned_ve}
    )
    result = planner.place(host, settings_)
    pinned_cores = frozenset(c for s in pinned_ve for c in range(s, s + ve_tp))
    assert (result is not None) == brute_force_fits(core_count, pinned_cores, ve_tp, pd_tp, 0, num_pd)
    if result is not None:
        assert result["ve"] == list(pinned_ve)
        plan = planner.plan_fleet(settings_, [host])
        assert_valid(plan, host, settings_)
        for engine in plan["n1"]["engines"]:  # the i-th pinned VE slice gets the i-th VE port
            if engine["role"] == "ve":
                assert engine["port"] == settings_.ve_port_base + pinned_ve.index(engine["cores"][0])
