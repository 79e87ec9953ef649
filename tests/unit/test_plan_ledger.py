"""Rent-or-buy of the dense attention kernel's plans (encgraph.packing.kernels): the crossover's interpolated
times and plan cost, the rule per head geometry, and the per-thread ledger. Pure Python: no torch."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from encgraph.errors import ConfigError
from encgraph.packing.kernels import BUCKET_SLACK, PER_OCTAVE, Crossover, DenseRule, PlanLedger, bucket_rows

LENGTHS = (256, 1024, 4096, 16384)


def crossover(first: tuple[float, ...] = (36.0, 36.0, 37.0, 40.0)) -> Crossover:
    # quadratic-ish: varlen 1.6x dense at length, as measured on an H200 at 16 x 72
    dense = (0.02, 0.06, 0.6, 8.0)
    return Crossover("gpu", 16, 72, "bfloat16", LENGTHS, tuple(1.6 * d for d in dense), dense, dense_first_ms=first)


def test_plan_ms_is_the_median_first_call_surplus():
    c = crossover()
    assert c.plan_ms == pytest.approx(36.0 - 0.06 / 2 - 0.6 / 2 + 0.0, abs=0.5)
    assert Crossover("gpu", 1, 8, "bfloat16", (1,), (1.0,), (1.0,)).plan_ms == 0.0  # none recorded
    # a first call faster than the median (noise) never makes a negative plan
    assert crossover(first=(0.0, 0.0, 0.0, 0.0)).plan_ms == 0.0


def test_ms_at_hits_the_measured_points_and_extends_quadratically():
    c = crossover()
    for n, v, d in zip(c.lengths, c.varlen_ms, c.dense_ms):
        assert c.ms_at(n) == pytest.approx((v, d))
    v, d = c.ms_at(32768)  # past the longest: the last pair's slope, about quadratic here
    assert d == pytest.approx(8.0 * (8.0 / 0.6) ** 0.5, rel=1e-6) and v == pytest.approx(1.6 * d)
    single = Crossover("gpu", 1, 8, "bfloat16", (100,), (2.0,), (1.0,))
    assert single.ms_at(200) == pytest.approx((8.0, 4.0))


@given(st.integers(min_value=256, max_value=16384), st.integers(min_value=256, max_value=16384))
def test_ms_at_is_monotone_between_points(a, b):
    c = crossover()
    lo, hi = sorted((a, b))
    assert c.ms_at(lo)[0] <= c.ms_at(hi)[0] + 1e-12 and c.ms_at(lo)[1] <= c.ms_at(hi)[1] + 1e-12


def test_a_length_rents_until_its_missed_savings_pay_the_plan_then_buys():
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=27)
    ledger = PlanLedger()
    rows = 4096  # saves 0.36 ms a call, 9.7 a forward of 27 calls: under the 36 ms plan
    flags = [ledger.dense("g", rows, rule) for _ in range(27 * 4)]
    bought_at = flags.index(True)
    assert not any(flags[:bought_at]) and all(flags[bought_at:])
    missed = bought_at * rule.gain_ms(rows)
    assert missed < rule.plan_ms <= missed + 27 * rule.gain_ms(rows)  # bought once rent + a forward reaches it
    assert ledger.bought("g", rows) and not ledger.bought("other geometry", rows)
    assert ledger.stats() == {"bought": 1, "rented_calls": bought_at, "stand_in_calls": 0, "warmed": 0, "deferred": 0, "refining_calls": 0}


def test_a_long_length_buys_at_first_sight_and_short_ones_never_run_dense():
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=27)
    ledger = PlanLedger()
    assert ledger.dense("g", 16384, rule)  # saves 4.8 ms a call, 130 a forward
    assert not any(ledger.dense("g", 200, rule) for _ in range(1000))  # under min_rows
    assert not ledger.dense("g", 1, DenseRule(None, c))


def test_without_a_plan_cost_every_length_from_min_rows_runs_dense():
    ledger = PlanLedger()
    assert ledger.dense("g", 2048, DenseRule(2048)) and not ledger.dense("g", 2047, DenseRule(2048))
    no_first = Crossover("gpu", 16, 72, "bfloat16", LENGTHS, (1, 2, 3, 4), (1, 1, 1, 1))
    assert ledger.dense("g", 300, DenseRule(no_first.min_rows, no_first, calls=1))


def test_the_ledger_is_per_thread():
    """torch's cuDNN plan cache is per thread: a length bought on one thread is new on another."""
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=27)
    ledger = PlanLedger()
    assert ledger.dense("g", 16384, rule) and ledger.bought("g", 16384)
    seen: list[bool] = []
    t = threading.Thread(target=lambda: seen.append(ledger.bought("g", 16384)))
    t.start()
    t.join()
    assert seen == [False]
    ledger.clear()
    assert not ledger.bought("g", 16384)


def test_bad_calls_are_refused():
    with pytest.raises(ConfigError, match="calls"):
        DenseRule(10, None, calls=0)


def test_buying_buys_every_length_past_min_rows_at_once_and_restores():
    """Capture times eager forwards inside ``buying()``: their kernels are the steady ones the cost model prices."""
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=1)  # 4096 rows would rent many times over outside the block
    ledger = PlanLedger()
    with ledger.buying():
        assert ledger.dense("g", 4096, rule) and not ledger.dense("g", 100, rule)
        with ledger.buying():
            pass
        assert ledger.dense("g", 5000, rule)  # a nested block leaves the outer one buying
    assert not ledger.dense("g", 6000, rule)  # after the block: rent again
    assert ledger.stats() == {"bought": 2, "rented_calls": 1, "stand_in_calls": 0, "warmed": 0, "deferred": 0, "refining_calls": 0}


def _paid(ledger: PlanLedger, key: str, rows: list[int], rule: DenseRule, builder=None) -> float:
    """What one forward of ``rule.calls`` attention calls over ``rows`` loses to rent, as ``dense`` decides call
    by call: each rented call misses its saving, except those of a length from the call where it fell due in this
    forward (its purchase, inside a deferring block)."""
    total = 0.0
    due_before = set(ledger._state()[2])
    for _ in range(rule.calls):
        for n in rows:
            run = ledger.run_length(key, n, rule, builder)
            fallen = (entry := (key, rule.run_rows(n))) in ledger._state()[2] and entry not in due_before
            rented = run not in (rule.run_rows(n), n)  # on varlen (0) or standing in; not at its bucket or own length
            if rule.min_rows is not None and n >= rule.min_rows and rented and not fallen:
                total += rule.gain_ms(n, stand_in=run > 0)
    return total


@given(st.lists(st.lists(st.sampled_from([100, 2000, 4096, 4096, 6000, 9000, 16384]), max_size=4), max_size=6),
       st.integers(min_value=1, max_value=30))
def test_surcharge_is_what_the_forward_then_pays_and_changes_nothing(forwards, calls):
    """The runner prices an eager run with ``surcharge_ms`` before it runs: it must be what that forward's calls
    then lose to rent, for any history of earlier forwards, and reading it must leave the ledger as it was."""
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=calls)
    ledger = PlanLedger()
    for rows in forwards:
        before = (ledger.stats(), set(ledger._state()[0]), dict(ledger._state()[1]))
        predicted = ledger.surcharge_ms("g", rows, rule)
        assert (ledger.stats(), set(ledger._state()[0]), dict(ledger._state()[1])) == before
        assert predicted == pytest.approx(_paid(ledger, "g", rows, rule), abs=1e-9)


def test_surcharge_is_zero_where_nothing_rents():
    c = crossover()
    ledger = PlanLedger()
    assert ledger.surcharge_ms("g", [16384, 4096], DenseRule(2048)) == 0.0  # no plan cost: dense at once, free
    assert ledger.surcharge_ms("g", [16384], DenseRule(None, c)) == 0.0
    rule = DenseRule(c.min_rows, c, calls=27)
    assert ledger.surcharge_ms("g", [16384], rule) == 0.0  # saves more than the plan in one forward: bought
    with ledger.buying():  # every length buys at first sight
        assert ledger.surcharge_ms("g", [4096, 4096, 16384], rule) == 0.0
    assert ledger.surcharge_ms("g", [4096], rule) == pytest.approx(27 * rule.gain_ms(4096))  # rents a whole forward


@given(st.sampled_from([2000, 4096, 6000, 9000]), st.integers(min_value=1, max_value=40),
       st.integers(min_value=1, max_value=3))
def test_replays_in_place_of_renting_pay_rent_until_the_length_is_bought(rows, calls, copies):
    """Ski rental across replays: while an eager forward would rent, the runner may replay instead and record the
    rent (``rent``); the length is then bought by the first eager forward after its rent (plus one forward's
    saving) reaches the plan, and the rent paid by then never exceeds the plan by more than one forward's."""
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=calls)
    ledger = PlanLedger()
    forward = [rows] * copies  # an item's frames, or several images of one size
    gain = rule.gain_ms(rows)
    replays, paid, rented = 0, 0.0, 0
    while (surcharge := ledger.surcharge_ms("g", forward, rule)) > 0.0:
        assert surcharge <= calls * copies * gain + 1e-9  # the last may buy part-way through the forward
        calls_rented = ledger.rent("g", forward, rule)
        assert surcharge == pytest.approx(calls_rented * gain)
        replays, paid, rented = replays + 1, paid + surcharge, rented + calls_rented
        assert replays <= rule.plan_ms / (calls * gain) + 1
    assert paid <= rule.plan_ms + calls * copies * gain
    assert ledger.dense("g", rows, rule) and ledger.bought("g", rows)  # the next eager forward buys it
    assert ledger.stats() == {"bought": 1, "rented_calls": rented, "stand_in_calls": 0, "warmed": 0, "deferred": 0, "refining_calls": 0}


def bucketed(slack: float | tuple[float, ...] = 1.05) -> Crossover:
    c = crossover()
    slacks = slack if isinstance(slack, tuple) else (slack,) * len(LENGTHS)
    return Crossover("gpu", 16, 72, "bfloat16", LENGTHS, c.varlen_ms, c.dense_ms, dense_first_ms=c.dense_first_ms,
                     padded_ms=tuple(f * d for f, d in zip(slacks, c.dense_ms)))


@given(st.integers(min_value=1, max_value=1 << 20))
def test_a_bucket_holds_its_length_within_a_sixteenth(rows):
    b = bucket_rows(rows)
    assert rows <= b <= rows + max(rows / PER_OCTAVE, 8) and bucket_rows(b) == b
    assert b % 8 == 0 or b == rows  # whole kernel tiles; a length of 8 rows or fewer keeps its own
    assert bucket_rows(1 << 12) == 1 << 12  # a power of two is its own bucket


def test_bucketed_only_where_the_padded_kernel_costs_little():
    assert bucketed(1.05).bucket_from == LENGTHS[0] and bucketed(BUCKET_SLACK + 0.1).bucket_from > LENGTHS[-1]
    assert not crossover().bucketed  # no padded times measured: exact lengths, as before
    c = bucketed(1.05)
    assert c.run_rows(4000) == bucket_rows(4000) == 4096 and crossover().run_rows(4000) == 4000
    # at a bucket length the exact kernel (no padding); between, the padded kernel at the bucket
    assert c.dense_at(4096) == pytest.approx(c.ms_at(4096)[1])
    assert c.dense_at(3900) == pytest.approx(1.05 * c.ms_at(bucket_rows(3900))[1])
    assert Crossover.from_dict(c.to_dict()) == c


def test_buckets_start_where_the_padded_kernel_stays_cheap_to_the_longest_length():
    # As measured on an H200 at 16 x 72: the copies into the padded buffers dominate up to 4,096 rows.
    c = bucketed((2.2, 2.9, 1.12, 1.04))
    assert c.bucket_from == 4096 and c.run_rows(4000) == 4000 and c.run_rows(5000) == bucket_rows(5000) == 5120
    assert c.dense_at(4000) == pytest.approx(c.ms_at(4000)[1])  # exact below: its own plan, the exact kernel
    assert bucketed((1.0, 1.0, 1.5, 1.1)).bucket_from == 16384  # a costly length in between cuts the run
    # the longest decides; failing there, the ratio's fall past it (the padding's cost grows with the rows, the
    # kernel's with their square) puts the start at 16,384 x 0.3 / (slack - 1) rows
    assert bucketed((1.0, 1.0, 1.0, 1.3)).bucket_from == 24576
    # below bucket_from the exact rule of before: bought per exact length
    rule, ledger = DenseRule(256, c, calls=27), PlanLedger()
    while not ledger.dense("g", 2000, rule):
        pass
    assert ledger.bought("g", 2000) and not ledger.bought("g", bucket_rows(2000))


def test_lengths_of_one_bucket_share_its_plan_and_its_rent():
    rule = DenseRule(256, bucketed(), calls=27)
    ledger = PlanLedger()
    lengths = [3970, 4000, 4030, 4060, 4090]  # one bucket (3968, 4096]: 4096
    assert {bucket_rows(n) for n in lengths} == {4096}
    flags = [ledger.dense("g", lengths[i % len(lengths)], rule) for i in range(27 * 4)]
    bought_at = flags.index(True)
    assert all(flags[bought_at:]) and ledger.bought("g", 4096) and ledger.stats()["bought"] == 1
    # every length of the bucket now runs dense at once; the next bucket is new
    assert all(ledger.dense("g", n, rule) for n in (3969, 4096)) and not ledger.dense("g", 4100, rule)
    # two sequences of one bucket in one forward: one entry, its rent the sum of both's missed savings
    fresh = PlanLedger()
    def forwards_until_bought(ledger: PlanLedger, rows: list[int]) -> int:
        for n in range(1, 100):
            ledger.rent("g", rows, rule)
            if not ledger.surcharge_ms("g", rows, rule):  # nothing left to rent: bought at its next call
                return n
        raise AssertionError("never bought")

    alone, together = forwards_until_bought(PlanLedger(), [4000]), forwards_until_bought(fresh, [3980, 4000])
    assert together < alone  # the shared rent reaches the plan sooner


def test_a_length_built_ahead_runs_dense_at_once_and_is_counted_apart():
    rule = DenseRule(1024, crossover(), calls=4)
    ledger = PlanLedger()
    ledger.own("g", 4096)
    ledger.own("g", 4096)  # once per length
    assert ledger.bought("g", 4096) and ledger.dense("g", 4096, rule)
    assert ledger.surcharge_ms("g", [4096], rule) == 0.0
    assert ledger.stats() == {"bought": 0, "rented_calls": 0, "stand_in_calls": 0, "warmed": 1, "deferred": 0, "refining_calls": 0}
    seen = []
    t = threading.Thread(target=lambda: seen.append(ledger.bought("g", 4096)))  # per thread, as torch's plans
    t.start()
    t.join()
    assert seen == [False]


def h200() -> Crossover:
    """16 heads x 72 as the photo run measured it on an H200 (ms): the eager padded call (issued back to back)
    costs 3x the exact kernel at 4,096 rows, beats varlen from 8,192, and buckets only from 16,384."""
    return Crossover("gpu", 16, 72, "bfloat16", (4096, 8192, 16384), (0.353, 1.357, 5.241), (0.249, 0.770, 3.062),
                     dense_first_ms=(80.0, 55.0, 70.0), padded_ms=(0.761, 1.088, 3.476))


def test_a_rented_length_stands_in_at_its_bucket_where_that_plan_is_held():
    """Below ``bucket_from`` a sequence runs dense at its own length once bought; until then it rents, on
    varlen, or padded to its bucket where this thread holds that bucket's plan (capture builds them), which is
    faster. Its rent then grows by the padded call's smaller miss, so the exact plan is bought later."""
    c = h200()
    assert (c.min_rows, c.bucket_from, c.stand_in_from) == (4096, 16384, 8192)
    rule = DenseRule(c.min_rows, c, calls=27)
    assert rule.warm_from == 8192 and DenseRule(c.min_rows, c, 27, replayed=True).warm_from is None
    rows, bucket = 9000, bucket_rows(9000)
    assert rule.stand_in_rows(rows) == bucket == 9216 and c.stand_in(rows)[1] < c.ms_at(rows)[0]
    assert 0 < rule.gain_ms(rows, stand_in=True) < rule.gain_ms(rows)

    def until_bought(ledger: PlanLedger) -> list[int]:
        runs = []
        while (run := ledger.run_length("g", rows, rule)) != rows:
            runs.append(run)
        return runs

    plain = until_bought(PlanLedger())
    assert set(plain) == {0}  # no bucket held: varlen
    ledger = PlanLedger()
    ledger.own("g", bucket)
    held = until_bought(ledger)
    assert set(held) == {bucket} and len(held) > len(plain)  # padded meanwhile, the exact plan bought later
    missed = len(held) * rule.gain_ms(rows, stand_in=True)
    assert missed < rule.plan_ms <= missed + 27 * rule.gain_ms(rows, stand_in=True)
    assert ledger.stats() == {"bought": 1, "rented_calls": len(held), "stand_in_calls": len(held), "warmed": 1, "deferred": 0, "refining_calls": 0}
    assert ledger.run_length("g", rows, rule) == rows  # steady: the exact length, as before
    # none under stand_in_from (the padded call loses to varlen there), none at a bucket length (its own run
    # length), none from bucket_from (the run length is the bucket), none between a piecewise replay's segments
    # without the padded call's replayed times
    ledger.own("g", bucket_rows(5000))
    assert rule.stand_in_rows(5000) is None and ledger.run_length("g", 5000, rule) == 0
    assert rule.stand_in_rows(9216) is None and rule.stand_in_rows(17000) is None and rule.run_rows(17000) == 17408
    assert DenseRule(c.min_rows, c, 27, replayed=True).stand_in_rows(rows) is None
    assert Crossover.from_dict(c.to_dict()) == c and c.to_dict()["stand_in_from"] == 8192
    no_padded = Crossover("gpu", 16, 72, "bfloat16", c.lengths, c.varlen_ms, c.dense_ms)
    assert no_padded.stand_in_from is None and DenseRule(4096, no_padded).stand_in_rows(rows) is None


@given(st.lists(st.lists(st.integers(min_value=3000, max_value=20000), max_size=3), max_size=6),
       st.integers(min_value=1, max_value=30), st.sets(st.sampled_from([8704, 9216, 9728, 12288, 15360])))
def test_surcharge_with_stand_ins_is_what_the_forward_then_pays(forwards, calls, held):
    """The runner's price of an eager forward counts a rented call standing in padded at its bucket's miss, not
    varlen's: for any history and any buckets held, what the forward then loses."""
    c = h200()
    rule = DenseRule(c.min_rows, c, calls=calls)
    ledger = PlanLedger()
    for bucket in held:
        ledger.own("g", bucket)
    for rows in forwards:
        predicted = ledger.surcharge_ms("g", rows, rule)
        assert predicted == pytest.approx(_paid(ledger, "g", rows, rule), abs=1e-9)
    stand_ins = ledger.stats()["stand_in_calls"]
    assert stand_ins == 0 or held  # only at a bucket held


# ------------------------------------------------------------------------------------------- deferred purchases
class Builds:
    """A builder factory (``PlanLedger.run_length``'s ``builder``) recording each build: ``(rows, thread)``."""

    def __init__(self, fail: bool = False) -> None:
        self.made = 0
        self.built: list[tuple[int, str]] = []
        self.fail = fail

    def __call__(self):
        self.made += 1

        def build(rows: int) -> None:
            self.built.append((rows, threading.current_thread().name))
            if self.fail:
                raise MemoryError("scratch")

        return build


def ripe(ledger: PlanLedger, rule: DenseRule, *keys: str, rows: int = 16384) -> None:
    """Pay each length's rent through replays (``rent``, outside any block) until its next call buys it."""
    for key in keys:
        while ledger.surcharge_ms(key, [rows], rule) > 0:
            ledger.rent(key, [rows], rule)


def test_a_purchase_inside_deferring_falls_due_rents_on_and_is_built_as_the_block_ends():
    """Inside ``deferring()`` the call whose rent reaches the plan does not build it: it and the block's later
    calls keep renting (standing in where they may), and the plan is built once, when the block ends; later calls
    run dense at once. The builder factory is called once, when the length falls due."""
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=27)
    ledger, builds = PlanLedger(), Builds()
    rows = 4096
    outside = PlanLedger()
    bought_at = [outside.dense("g", rows, rule) for _ in range(27 * 4)].index(True)  # the inline purchase's call
    with ledger.deferring():
        flags = [ledger.dense("g", rows, rule, builds) for _ in range(27 * 4)]
        assert not any(flags) and builds.built == [] and ledger.due() == 1 and builds.made == 1
    assert builds.built == [(rows, threading.current_thread().name)] and ledger.due() == 0
    assert ledger.dense("g", rows, rule, builds) and ledger.bought("g", rows)
    assert ledger.stats() == {"bought": 1, "rented_calls": 27 * 4, "stand_in_calls": 0, "warmed": 0, "deferred": 1, "refining_calls": 0}
    assert bought_at < 27 * 4  # the same calls outside the block would have bought it on the way


def test_without_a_builder_outside_a_block_or_at_first_sight_the_call_at_hand_buys():
    """A length whose one forward saves more than its plan (bought at first sight) is built by the call at hand
    inside a block too: the forward's later calls gain more from it than the deferral saves."""
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=1)
    ledger, builds = PlanLedger(), Builds()
    ripe(ledger, rule, "g", "h")
    with ledger.deferring():
        assert ledger.dense("g", 16384, rule)  # no builder: bought by this call, as before
    assert ledger.dense("h", 16384, rule, builds) and builds.made == 0  # no block: the builder is never asked
    with ledger.deferring():  # 27 calls save 130 ms a forward against a 36 ms plan
        assert ledger.dense("i", 16384, DenseRule(c.min_rows, c, calls=27), builds) and builds.made == 0
    assert ledger.stats()["deferred"] == 0 and ledger.stats()["bought"] == 3


def test_blocks_nest_and_a_front_builds_when_it_chooses():
    """Only the outermost block builds, and only with ``build=True``; each outermost end ages what is due, and
    ``build_due(min_age=)`` builds those that waited that long (the serving front under a queue that never
    empties). A block that raises builds nothing; outside any block a due length's next call buys it itself."""
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=1)
    ledger, builds = PlanLedger(), Builds()
    ripe(ledger, rule, "a", "b", "c")
    with ledger.deferring(build=False):
        with ledger.deferring():  # inner: its end builds nothing
            assert not ledger.dense("a", 16384, rule, builds)
        assert ledger.due() == 1 and builds.built == []
    with ledger.deferring(build=False):
        assert not ledger.dense("b", 16384, rule, builds) and not ledger.dense("a", 16384, rule, builds)
    assert ledger.due() == 2
    assert ledger.build_due(min_age=2) == 1 and [r for r, _ in builds.built] == [16384]  # "a" waited 2 blocks
    assert ledger.bought("a", 16384) and not ledger.bought("b", 16384)
    with pytest.raises(RuntimeError, match="boom"), ledger.deferring():
        assert not ledger.dense("c", 16384, rule, builds)
        raise RuntimeError("boom")
    assert ledger.due() == 2 and len(builds.built) == 1  # nothing built after the exception
    assert ledger.dense("b", 16384, rule, builds)  # outside a block: bought by the call at hand, no longer due
    assert ledger.due() == 1 and len(builds.built) == 1
    assert ledger.build_due() == 1 and ledger.bought("c", 16384) and ledger.due() == 0


def test_a_failed_build_is_logged_and_its_length_held(caplog):
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=1)
    ledger, builds = PlanLedger(), Builds(fail=True)
    ripe(ledger, rule, "g")
    with caplog.at_level("WARNING", logger="encgraph"), ledger.deferring():
        assert not ledger.dense("g", 16384, rule, builds)
    assert len(builds.built) == 1 and "building the dense attention plan of 16384 rows ahead failed" in caplog.text
    assert "MemoryError" in caplog.text and ledger.dense("g", 16384, rule, builds) and ledger.due() == 0


def test_due_lengths_are_per_thread():
    """A plan is built in the thread that will run its calls (torch's cache is per thread): another thread's
    ``build_due`` builds none of this thread's."""
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=1)
    ledger, builds = PlanLedger(), Builds()
    ripe(ledger, rule, "g")
    with ledger.deferring(build=False):
        assert not ledger.dense("g", 16384, rule, builds)
    other: list[int] = []
    t = threading.Thread(target=lambda: other.append(ledger.build_due()), name="other")
    t.start()
    t.join()
    assert other == [0] and ledger.due() == 1 and builds.built == []
    assert ledger.build_due() == 1 and builds.built == [(16384, threading.current_thread().name)]


@given(st.lists(st.lists(st.sampled_from([100, 2000, 4096, 4096, 6000, 9000, 16384]), max_size=4), max_size=6),
       st.integers(min_value=1, max_value=30), st.lists(st.booleans(), min_size=6, max_size=6))
def test_surcharge_inside_deferring_is_what_the_forward_then_pays(forwards, calls, build_after):
    """Priced inside a deferring block (the runner's), a forward's surcharge is what it then loses to rent, for
    any history, whether or not earlier blocks built their due lengths: the calls of a length due before it
    counted, those after a length falls due in it not (its purchase, as the plan itself; counted, a replay would
    look cheaper at every call and the length, renting through replays, would never fall due)."""
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=calls)
    ledger, builds = PlanLedger(), Builds()
    for rows, build in zip(forwards, build_after):
        with ledger.deferring(build=build):
            predicted = ledger.surcharge_ms("g", rows, rule)
            assert predicted == pytest.approx(_paid(ledger, "g", rows, rule, builds), abs=1e-9)
    assert len(builds.built) <= ledger.stats()["deferred"] == builds.made


@given(st.sampled_from([2000, 4096, 6000, 9000]), st.integers(min_value=1, max_value=40))
def test_a_length_renting_through_replays_still_falls_due_and_is_built(rows, calls):
    """The runner replays a batch in place of an eager forward that would rent (``rent``), and runs the eager
    forward once its surcharge is 0. Inside deferring blocks that forward must come: were the calls after a
    length falls due priced, the surcharge would stay positive and the length rent through replays for ever."""
    c = crossover()
    rule = DenseRule(c.min_rows, c, calls=calls)
    ledger, builds = PlanLedger(), Builds()
    for forward in range(1000):
        with ledger.deferring():
            if ledger.surcharge_ms("g", [rows], rule) > 0:
                ledger.rent("g", [rows], rule)
            else:
                _paid(ledger, "g", [rows], rule, builds)
        if ledger.bought("g", rows):
            break
    at_first_sight = rule.rent_ms(rows, 0.0) is None  # bought by the call at hand, not deferred
    assert ledger.bought("g", rows) and [r for r, _ in builds.built] == ([] if at_first_sight else [rows]), forward


# ------------------------------------------------------------------------------------ exact lengths past buckets
def test_a_size_at_a_bucket_held_rents_its_own_length_and_buys_it_once_paid():
    """From ``bucket_from`` a sequence runs at its bucket; where this thread holds the bucket's plan, its own
    length rents by what the padding costs (``refine_ms``) and is bought once that pays the plan, so a recurring
    photo size ends on the exact kernel (as the tower's own SDPA holds it) while a new one still pays no plan.
    Lengths of one bucket rent apart; a bucket length never refines; the cost model's price (at the bucket) sees
    no rent, and nothing counts as rented."""
    c = h200()
    rule = DenseRule(c.min_rows, c, calls=27)
    ledger = PlanLedger()
    rows, other = 19457, 19900
    bucket = bucket_rows(rows)
    assert bucket == bucket_rows(other) == 20480 and rule.run_rows(rows) == bucket
    ledger.own("g", bucket)
    gain = rule.refine_ms(rows)
    assert 0 < 27 * gain < rule.plan_ms  # about 0.74 ms a call: rented over a few forwards
    runs = []
    for _ in range(10):
        assert ledger.surcharge_ms("g", [rows], rule) == 0.0
        runs += [ledger.run_length("g", rows, rule) for _ in range(27)]
    first = runs.index(rows)
    assert set(runs[:first]) == {bucket} and set(runs[first:]) == {rows}
    assert first * gain < rule.plan_ms <= (first + 27) * gain + 1e-9  # the rent rule's moment
    assert ledger.run_length("g", other, rule) == bucket  # its own rent, from nothing
    assert ledger.run_length("g", bucket, rule) == bucket and rule.refine_ms(bucket) is None
    assert ledger.stats() == {"bought": 1, "rented_calls": 0, "stand_in_calls": 0, "warmed": 1, "deferred": 0,
                              "refining_calls": first + 1}


def test_an_exact_length_past_the_buckets_falls_due_inside_a_block():
    c = h200()
    rule = DenseRule(c.min_rows, c, calls=27)
    ledger, builds = PlanLedger(), Builds()
    ledger.own("g", 20480)
    with ledger.deferring():
        runs = [ledger.run_length("g", 19457, rule, builds) for _ in range(27 * 10)]
        assert set(runs) == {20480} and ledger.due() == 1 and builds.built == []
    assert [r for r, _ in builds.built] == [19457] and ledger.run_length("g", 19457, rule, builds) == 19457
    with ledger.buying():  # capture times eager forwards at their steady kernels: the bucket, as priced
        assert ledger.run_length("g", 19900, rule, builds) == 20480
