"""Budgets and the planner: exhaustive and property tests; the replicas' batch queue (plain
Python)."""
import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.baselines import GreedyPlanner, doubling_budgets
from scheduler import (GLOBAL_UNIT_TOKENS, LOCAL_UNIT_TOKENS, Item, PathBudgets, PathStats, Planner,
                       default_budgets, fill_gaps, geometric_units, path_plan)


def test_geometric_units():
    assert geometric_units(32) == [1, 2, 3, 4, 6, 9, 13, 19, 28, 32]
    assert geometric_units(1) == [1]
    assert geometric_units(10, growth=2.0) == [1, 2, 4, 8, 10]


@given(st.integers(1, 500), st.floats(1.05, 3.0))
def test_geometric_units_properties(max_units, growth):
    units = geometric_units(max_units, growth)
    assert units[0] == 1 and units[-1] == max_units
    for a, b in zip(units, units[1:]):
        assert b > a and (b <= a * growth or b == a + 1 or b == max_units)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=8, unique=True), st.floats(1.1, 2.5))
def test_fill_gaps(units, growth):
    units = sorted(units)
    filled = fill_gaps(units, growth)
    assert set(units) <= set(filled) and filled == sorted(set(filled))
    for a, b in zip(filled, filled[1:]):
        assert b <= max(a + 1, int(a * growth))


def test_default_budgets_are_unit_aligned():
    g, loc = default_budgets()
    assert g.unit == GLOBAL_UNIT_TOKENS == 272 and loc.unit == LOCAL_UNIT_TOKENS == 100
    assert g.capacities == (1, 2, 3, 4, 6, 9, 13, 19, 28, 32)
    # Page-aligned: 6 crops times every global capacity, small steps below one page.
    assert loc.capacities == (1, 2, 3, 4, 6, 9, 12, 18, 24, 36, 54, 78, 114, 168, 192)
    assert all(6 * c in loc.capacities for c in g.capacities)
    assert doubling_budgets()[0].capacities == (1, 2, 4, 8, 16, 32)


@pytest.mark.parametrize("budgets, match", [((), "no budgets"), ((200, 100), "ascending"),
                                             ((100, 150), "multiples"), ((0, 100), "multiples")])
def test_bad_budgets(budgets, match):
    with pytest.raises(ValueError, match=match):
        PathBudgets("local", 100, budgets)


def test_smallest_fitting():
    b = PathBudgets.explicit("local", 100, [300, 100, 600])
    assert [b.smallest_fitting(u) for u in range(8)] == [100, 100, 300, 300, 600, 600, 600, None]


def test_path_plan_skip_eager_padding():
    b = PathBudgets.explicit("local", 100, [100, 400])
    assert path_plan(b, 0).skipped and not path_plan(b, 0).eager
    assert path_plan(b, 5).eager and path_plan(b, 5).padding == 0
    p = path_plan(b, 3)
    assert (p.budget, p.capacity, p.tokens, p.padding) == (400, 4, 300, 100)


def test_two_replays_where_they_pad_less_by_more_than_a_view():
    """DeepSeek-OCR 2's default budgets (256 a global view, 144 a crop; 32 pages of 6 crops)."""
    global_budgets, local_budgets = default_budgets(32, global_unit=256, local_unit=144)
    assert global_budgets.replays(16) == (13 * 256, 3 * 256)  # 19 would pad 3 views
    assert global_budgets.replays(8) == (9 * 256,)  # 6 + 2 saves one view: the second replay's price
    assert global_budgets.replays(9) == (9 * 256,)  # exact
    assert global_budgets.replays(33) == ()  # past the largest: eager
    assert local_budgets.replays(48) == (36 * 144, 12 * 144)  # 8 pages of 6 crops; 54 pads 6
    b = PathBudgets.explicit("local", 100, [100, 400])
    assert b.replays(3) == (400,) and b.replays(2) == (100, 100)  # the same graph twice: 2 views saved
    for units in range(1, 193):
        replays = local_budgets.replays(units)
        single = local_budgets.smallest_fitting(units)
        assert sum(replays) >= units * 144 and len(replays) in (1, 2)
        assert replays == (single,) or sum(replays) + 144 < single
        if len(replays) == 2:
            assert replays[0] <= units * 144 <= replays[0] + replays[1]


def test_planner_with_split_replays_pads_less_and_keeps_the_batches():
    global_budgets, local_budgets = default_budgets(32, global_unit=256, local_unit=144)
    items = [Item(1, 6)] * 8 + [Item(1, 0)] * 8  # 16 pages: 8 tiled, 8 whole
    one, two = (Planner(global_budgets, local_budgets, 32, split_replays=split).plan(items)
                for split in (False, True))
    assert [b.indices for b in one.batches] == [b.indices for b in two.batches]
    [batch] = two.batches
    assert batch.global_path.replays == (13 * 256, 3 * 256) and batch.global_path.padding == 0
    assert batch.local_path.replays == (36 * 144, 12 * 144) and batch.local_path.padding == 0
    assert one.batches[0].local_path.replays == (54 * 144,) and one.padded_tokens == 3 * 256 + 6 * 144
    assert two.batches[0].global_path.capacity == 16 and one.batches[0].global_path.capacity == 19


items_st = st.lists(st.builds(Item, st.integers(0, 2), st.integers(0, 12)), max_size=60)
budget_st = st.lists(st.integers(1, 40), min_size=1, max_size=6, unique=True)


def make_planner(g_units, l_units, max_items, strategy="dp"):
    planner = {"dp": Planner, "greedy": GreedyPlanner}[strategy]
    return planner(PathBudgets.explicit("global", 272, [u * 272 for u in g_units]),
                   PathBudgets.explicit("local", 100, [u * 100 for u in l_units]), max_items)


@settings(max_examples=300, deadline=None)
@given(items_st, budget_st, budget_st, st.integers(1, 40), st.sampled_from(["dp", "greedy"]))
def test_plan_properties(items, g_units, l_units, max_items, strategy):
    planner = make_planner(g_units, l_units, max_items, strategy)
    plan = planner.plan(items)
    placed = [i for b in plan.batches for i in b.indices]
    assert sorted(placed) == list(range(len(items)))  # every item exactly once
    for batch in plan.batches:
        assert 1 <= len(batch.indices) <= max_items
        for path, budgets, units in [
                (batch.global_path, planner.global_budgets, sum(items[i].global_views for i in batch.indices)),
                (batch.local_path, planner.local_budgets, sum(items[i].crops for i in batch.indices))]:
            assert path.units == units
            fitting = [b for b in budgets.budgets if b >= units * budgets.unit]
            if units == 0:
                assert path.skipped
            elif fitting:
                assert path.budget == min(fitting)  # the smallest budget that fits
            else:  # over every budget: only ever a lone oversized item, run eagerly
                assert path.eager and len(batch.indices) == 1
    # Results come back in queue order whatever the batching.
    assert plan.in_queue_order([list(b.indices) for b in plan.batches]) == list(range(len(items)))


@settings(max_examples=300, deadline=None)
@given(items_st, budget_st, budget_st, st.integers(1, 40))
def test_dp_never_worse_than_greedy(items, g_units, l_units, max_items):
    dp = make_planner(g_units, l_units, max_items, "dp").plan(items)
    greedy = make_planner(g_units, l_units, max_items, "greedy").plan(items)
    assert len(dp.batches) == len(greedy.batches)
    assert dp.padded_tokens <= greedy.padded_tokens


def test_dp_beats_greedy_on_an_example():
    # Crop budgets 4 and 8, two images per batch, crops (4, 2, 2) in sorted order. Greedy takes
    # [4, 2] (6 crops -> budget 8) then [2] (-> 4): 400 padded crop tokens. DP cuts [4] | [2, 2]:
    # both exactly 4, no padding, same number of batches.
    items = [Item(1, c) for c in (4, 2, 2)]
    greedy = make_planner([1, 2], [4, 8], 2, "greedy").plan(items)
    dp = make_planner([1, 2], [4, 8], 2, "dp").plan(items)
    assert [b.indices for b in greedy.batches] == [(0, 1), (2,)]
    assert [b.indices for b in dp.batches] == [(0,), (1, 2)]
    assert (greedy.padded_tokens, dp.padded_tokens) == (400, 0)


def test_mixed_batch_paths():
    planner = make_planner([1, 2, 4], [1, 2, 4, 8], 4, "dp")
    plan = planner.plan([Item(1, 0), Item(1, 6), Item(1, 0)])
    (batch,) = plan.batches
    assert batch.global_path.budget == 4 * 272 and batch.local_path.budget == 8 * 100


def test_oversized_item_runs_its_path_eagerly_alone():
    planner = make_planner([1, 2], [2, 4], 4, "dp")
    plan = planner.plan([Item(1, 2), Item(1, 9), Item(1, 0)])
    big = next(b for b in plan.batches if 1 in b.indices)
    assert big.indices == (1,) and big.local_path.eager and big.global_path.budget == 272


def test_empty_queue_and_bad_args():
    assert make_planner([1], [1], 1, "dp").plan([]).batches == []
    with pytest.raises(ValueError, match="max_items"):
        make_planner([1], [1], 0, "dp")
    with pytest.raises(ValueError, match="negative"):
        make_planner([1], [1], 1, "dp").plan([Item(1, -1)])


def test_in_queue_order_checks_counts():
    plan = make_planner([4], [4], 4, "dp").plan([Item(1, 0), Item(1, 0)])
    with pytest.raises(ValueError, match="results for a batch"):
        plan.in_queue_order([[1]])


def test_stats():
    stats = PathStats()
    b = PathBudgets.explicit("local", 100, [100, 400])
    stats.record(path_plan(b, 3), replayed=True)
    stats.record(path_plan(b, 5), replayed=False)
    stats.record(path_plan(b, 0), replayed=False)
    d = stats.as_dict()
    assert (d["graph_hits"], d["graph_misses"], d["skipped"]) == (1, 1, 1)
    assert (d["real_tokens"], d["padded_tokens"]) == (800, 100)
    assert d["padding_fraction"] == pytest.approx(100 / 900)
    assert d["batch_sizes"] == {3: 1, 5: 1}


# --- the replicas' batch queue ----------------------------------------------------------------


def test_batch_queue_takes_what_queued_while_the_batch_before_ran():
    """One batch at a time; a lone item runs at once; the items that arrive one by one while a
    batch runs all go into the next batch (Serve's @serve.batch made each its own batch)."""
    from scheduler import BatchQueue
    batches, running = [], []

    async def run(items):
        running.append(1)
        assert len(running) == 1, "two batches at once"
        batches.append(list(items))
        await asyncio.sleep(0.05)
        running.pop()
        return [i * 10 for i in items]

    async def scenario():
        queue = BatchQueue(run, max_size=4)
        first = asyncio.ensure_future(queue.submit(0))
        await asyncio.sleep(0.01)  # the first batch is running now
        later = []
        for i in range(1, 7):
            later.append(asyncio.ensure_future(queue.submit(i)))
            await asyncio.sleep(0.002)  # one by one
        return await asyncio.gather(first, *later), queue.batches
    results, count = asyncio.run(scenario())
    assert results == [0, 10, 20, 30, 40, 50, 60]
    assert batches == [[0], [1, 2, 3, 4], [5, 6]] and count == 3


def recorded(batches: list):
    """A batch runner that records each batch it runs and answers each item with itself."""
    async def run(items):
        batches.append(list(items))
        await asyncio.sleep(0.02)
        return items
    return run


def test_batch_queue_runs_batch_jobs_items_only_when_no_interactive_item_waits():
    """Batch jobs' items queued first wait while interactive ones arrive: each batch takes the
    interactive items waiting (never mixed with batch items), and the batch items run after."""
    from scheduler import BatchQueue
    batches = []
    run = recorded(batches)

    async def scenario():
        queue = BatchQueue(run, max_size=3, batch_max_size=3)
        first = asyncio.ensure_future(queue.submit("i0"))
        await asyncio.sleep(0.005)  # running
        jobs = [asyncio.ensure_future(queue.submit(f"b{i}", batch=True)) for i in range(4)]
        asked = [asyncio.ensure_future(queue.submit(f"i{i}")) for i in range(1, 3)]
        await asyncio.sleep(0)
        assert queue.queued() == 6
        return await asyncio.gather(first, *jobs, *asked)
    assert asyncio.run(scenario()) == ["i0", "b0", "b1", "b2", "b3", "i1", "i2"]
    assert batches == [["i0"], ["i1", "i2"], ["b0", "b1", "b2"], ["b3"]]
    assert BatchQueue(run, max_size=64).batch_max_size == 16  # batch jobs' batches: a quarter


def test_batch_queue_counts_sizes_runs_oversized_items_alone_and_survives_errors():
    from scheduler import BatchQueue
    batches = []

    async def run(items):
        batches.append(list(items))
        if "bad" in items:
            raise ValueError("a bad batch")
        return [len(i) for i in items]

    async def scenario():
        # Sizes are string lengths: "aa" + "bb" fit 4, "ccccc" alone exceeds it and runs alone.
        queue = BatchQueue(run, max_size=4, size_of=lambda items: sum(len(i) for i in items))
        blocker = asyncio.ensure_future(queue.submit("x"))
        await asyncio.sleep(0)
        calls = [asyncio.ensure_future(queue.submit(s)) for s in ("aa", "bb", "ccccc", "d")]
        got = await asyncio.gather(blocker, *calls)
        failed = asyncio.ensure_future(queue.submit("bad"))
        with pytest.raises(ValueError, match="a bad batch"):
            await failed
        return got, await queue.submit("after")  # the queue goes on after a failed batch
    got, after = asyncio.run(scenario())
    assert got == [1, 2, 2, 5, 1] and after == 5
    assert batches == [["x"], ["aa", "bb"], ["ccccc"], ["d"], ["bad"], ["after"]]


def test_batch_queue_skips_items_of_cancelled_callers():
    from scheduler import BatchQueue
    batches = []
    run = recorded(batches)

    async def scenario():
        queue = BatchQueue(run, max_size=8)
        first = asyncio.ensure_future(queue.submit(1))
        await asyncio.sleep(0.005)
        gone, kept = asyncio.ensure_future(queue.submit(2)), asyncio.ensure_future(queue.submit(3))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)  # the cancellation reaches the item's future
        assert queue.queued() == 1
        return await first, await kept
    assert asyncio.run(scenario()) == (1, 3)
    assert batches == [[1], [3]]

