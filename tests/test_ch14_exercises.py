"""Chapter 14 checkers: the reference passes, common mistakes are named, unfinished work is reported."""
from engine.exercises import ch14


def test_step_floor_checker(capsys):
    assert ch14.check_step_floor_ms(ch14.step_floor_ms_ref)

    def weights_only(c, b, n, bw, bpv):
        return c.num_parameters() * bpv / (bw * 1e9) * 1e3
    assert not ch14.check_step_floor_ms(weights_only)
    assert "K/V reads are missing" in capsys.readouterr().out

    def in_seconds(c, b, n, bw, bpv):
        return ch14.step_floor_ms_ref(c, b, n, bw, bpv) / 1e3
    assert not ch14.check_step_floor_ms(in_seconds)
    assert "milliseconds" in capsys.readouterr().out


def test_bottleneck_checker(capsys):
    assert ch14.check_bottleneck(ch14.bottleneck_ref)
    assert not ch14.check_bottleneck(lambda tl: ch14.bottleneck_ref(ch14._close_gaps(tl)))
    assert "not counted as idle" in capsys.readouterr().out
    assert not ch14.check_bottleneck(ch14._longest_call)
    assert "summed" in capsys.readouterr().out

    def unfinished(tl):
        raise NotImplementedError
    assert not ch14.check_bottleneck(unfinished)
    assert "not attempted" in capsys.readouterr().out


def test_idle_gaps_make_the_bottleneck():
    timeline = [["gemm", 0.0, 1.0], ["norm", 3.0, 3.5], ["gemm", 3.5, 4.0]]
    assert ch14.bottleneck_ref(timeline) == ("idle", 0.5)
    assert ch14.bottleneck_ref([["gemm", 0.0, 1.0], ["norm", 1.0, 1.5], ["gemm", 1.5, 2.0]]) == ("gemm", 0.75)


def test_overlap_checker(capsys):
    assert ch14.check_overlapped_tok_per_s(ch14.overlapped_tok_per_s_ref)

    def serial(h, g, t):
        return t / ((h + g) / 1e3)
    assert not ch14.check_overlapped_tok_per_s(serial)
    assert "one after the other" in capsys.readouterr().out

    def gpu_only(h, g, t):
        return t / (g / 1e3)
    assert not ch14.check_overlapped_tok_per_s(gpu_only)
    assert "host's time was left out" in capsys.readouterr().out

    def shortest(h, g, t):
        return t / (min(h, g) / 1e3)
    assert not ch14.check_overlapped_tok_per_s(shortest)
    assert "max, not min" in capsys.readouterr().out

    def per_ms(h, g, t):
        return t / max(h, g)
    assert not ch14.check_overlapped_tok_per_s(per_ms)
    assert "milliseconds" in capsys.readouterr().out

    def unfinished(h, g, t):
        raise NotImplementedError
    assert not ch14.check_overlapped_tok_per_s(unfinished)
    assert "not attempted" in capsys.readouterr().out


def test_overlap_bounds_the_measured_serving_step():
    # 1,103 steps of 128 output tokens: 5.29 ms a step one after the other, ~3.5 ms overlapped
    assert round(ch14.overlapped_tok_per_s_ref(1.8, 3.5, 141304 / 1103), -2) == 36600
    assert ch14.overlapped_tok_per_s_ref(4.0, 2.0, 64) == ch14.overlapped_tok_per_s_ref(2.0, 4.0, 64) == 16000
