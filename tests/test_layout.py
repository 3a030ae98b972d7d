"""Pure layout tests: rank maps and validation errors, no process groups.

| layout                                         | world | ranks                                  |
|------------------------------------------------|-------|----------------------------------------|
| vision dp4 @0 + language tp2·dp2 @4            | 8     | vision 0-3, language 4-7               |
| vision tp2·pp2 @0 + language tp2·pp2 @4        | 8     | vision 0-3, language 4-7               |
| vision + audio share 0-1 (dp2) + language tp2  | 4     | encoders 0-1, language 2-3             |
| colocated vision tp2·dp4 + language tp4·dp2    | 8     | both 0-7                               |
| language tp2·cp2·dp2                           | 8     | 0-7                                    |

Expected rank lists are written out by hand from the documented order
(pp, dp, cp, tp; tp fastest), never computed by the code under test.
"""

import pytest

from dtensor_mimo import LayoutError, MimoLayout, Parallelism


def fan_in_layout():
    return MimoLayout({"vision": Parallelism(dp=4), "language": Parallelism(tp=2, dp=2)})


def test_fan_in_rank_map():
    layout = fan_in_layout()
    assert layout.world_size == 8
    assert layout.ranks("vision") == [0, 1, 2, 3]
    assert layout.ranks("language") == [4, 5, 6, 7]
    assert layout.groups("vision", "dp") == [[0, 1, 2, 3]]
    assert layout.groups("vision", "tp") == [[0], [1], [2], [3]]
    assert layout.groups("language", "tp") == [[4, 5], [6, 7]]
    assert layout.groups("language", "dp") == [[4, 6], [5, 7]]
    assert layout.coordinate("language", 7) == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}
    assert layout.coordinate("language", 3) is None
    assert layout.rank_grid("language") == [[[[4, 5]], [[6, 7]]]]


def test_pipelined_rank_map():
    layout = MimoLayout({"vision": Parallelism(tp=2, pp=2), "language": Parallelism(tp=2, pp=2)})
    assert layout.groups("vision", "pp") == [[0, 2], [1, 3]]
    assert layout.groups("language", "pp") == [[4, 6], [5, 7]]
    assert layout.groups("language", "tp") == [[4, 5], [6, 7]]
    assert [r for r in range(8) if layout.is_first_stage("language", r)] == [4, 5]
    assert not layout.is_first_stage("vision", 5)


def test_two_encoders_share_ranks():
    layout = MimoLayout(
        {"vision": Parallelism(dp=2), "audio": Parallelism(dp=2), "language": Parallelism(tp=2)},
        offsets={"vision": 0, "audio": 0, "language": 2},
    )
    assert layout.world_size == 4
    assert layout.ranks("audio") == [0, 1]
    assert layout.ranks("language") == [2, 3]
    assert layout.is_member("vision", 0) and layout.is_member("audio", 0) and not layout.is_member("language", 0)
    assert layout.shares_ranks("vision", "audio") and not layout.shares_ranks("vision", "language")
    assert "colocated with audio" in layout.describe()


def test_colocated_rank_map():
    layout = MimoLayout.colocated({"vision": Parallelism(tp=2, dp=4), "language": Parallelism(tp=4, dp=2)})
    assert layout.ranks("vision") == layout.ranks("language") == list(range(8))
    assert layout.groups("vision", "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("vision", "dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("language", "tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.groups("language", "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coordinate("vision", 5) == {"pp": 0, "dp": 2, "cp": 0, "tp": 1}
    assert layout.coordinate("language", 5) == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}


def test_tp_cp_dp_rank_map():
    layout = MimoLayout({"language": Parallelism(tp=2, cp=2, dp=2)})
    assert layout.groups("language", "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("language", "cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("language", "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("language", ("dp", "cp")) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.coordinate("language", 6) == {"pp": 0, "dp": 1, "cp": 1, "tp": 0}


def test_explicit_offsets_and_describe():
    layout = MimoLayout({"language": Parallelism(tp=2), "vision": Parallelism(dp=2)},
                        offsets={"language": 2, "vision": 0})
    assert layout.ranks("vision") == [0, 1]
    rows = {line.split()[0]: line.split() for line in layout.describe().splitlines()[2:]}
    assert rows["language"] == ["language", "1", "1", "1", "2", "2..3", "own", "ranks"]
    assert rows["vision"] == ["vision", "1", "2", "1", "1", "0..1", "own", "ranks"]


# ---------------------------------------------------------------- validation messages

@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 0}, "Parallelism.tp must be an integer >= 1, got 0"),
    ({"dp": -2}, "Parallelism.dp must be an integer >= 1, got -2"),
    ({"pp": 1.5}, "Parallelism.pp must be an integer >= 1, got 1.5"),
    ({"dp": 4, "dp_replicate": 0}, "Parallelism.dp_replicate must be an integer >= 1, got 0"),
    ({"dp": 4, "dp_replicate": 3}, "Parallelism.dp_replicate=3 must divide dp=4"),
])
def test_sizes_below_one(kwargs, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        Parallelism(**kwargs)


def test_hsdp_keeps_the_grid_and_names_itself():
    """dp_replicate only groups the dp ranks for FSDP2: ranks, size and coordinates are dp's."""
    hsdp, plain = Parallelism(dp=4, tp=2, dp_replicate=2), Parallelism(dp=4, tp=2)
    assert (hsdp.shape, hsdp.size, hsdp.hsdp, plain.hsdp) == (plain.shape, 8, True, False)
    assert (str(hsdp), str(plain)) == ("tp2·dp4r2", "tp2·dp4")
    layout = MimoLayout({"vision": {"dp": 2}, "language": {"dp": 4, "tp": 2, "dp_replicate": 2}})
    assert layout.ranks("language") == MimoLayout({"vision": {"dp": 2}, "language": plain}).ranks("language")
    assert "4 (2 replica groups)" in layout.describe()


def test_unknown_dim_names_module():
    with pytest.raises(ValueError, match=r"module 'vision': unknown parallel dim\(s\) \['ep'\]"):
        MimoLayout({"vision": {"dp": 2, "ep": 2}, "language": {"tp": 2}})


def test_size_inside_mapping_names_module():
    with pytest.raises(ValueError, match=r"module 'language': Parallelism.tp must be an integer >= 1, got 0"):
        MimoLayout({"vision": {"dp": 2}, "language": {"tp": 0}})


def test_product_exceeds_world():
    with pytest.raises(LayoutError, match=r"module 'language' \(tp2·dp2 = 4 ranks at offset 4\) needs "
                                          r"ranks 4..7, but the world has 6 ranks"):
        MimoLayout({"vision": Parallelism(dp=4), "language": Parallelism(tp=2, dp=2)}, world_size=6)


def test_partial_overlap():
    with pytest.raises(LayoutError, match=r"modules 'vision' \(dp4, ranks 0..3\) and 'language' "
                                          r"\(tp2, ranks 2..3\) partially overlap"):
        MimoLayout({"vision": Parallelism(dp=4), "language": Parallelism(tp=2)},
                   offsets={"vision": 0, "language": 2})


def test_gap():
    with pytest.raises(LayoutError, match=r"ranks 2..3 of the 6-rank world belong to no module"):
        MimoLayout({"vision": Parallelism(dp=2), "language": Parallelism(tp=2)},
                   offsets={"vision": 0, "language": 4})


def test_gap_at_end_of_world():
    with pytest.raises(LayoutError, match=r"ranks 4..7 of the 8-rank world belong to no module"):
        MimoLayout({"vision": Parallelism(dp=2), "language": Parallelism(tp=2)}, world_size=8)


def test_colocated_products_must_match():
    with pytest.raises(LayoutError, match=r"colocated modules must span the same number of ranks, "
                                          r"got vision tp2·dp4 = 8, language tp2 = 2"):
        MimoLayout.colocated({"vision": Parallelism(tp=2, dp=4), "language": Parallelism(tp=2)})


def test_offsets_must_name_every_module():
    with pytest.raises(LayoutError, match=r"missing \['language'\], unknown \['llm'\]"):
        MimoLayout({"vision": Parallelism(), "language": Parallelism()}, offsets={"vision": 0, "llm": 1})


def test_missing_language_module():
    layout = MimoLayout({"vision": Parallelism(dp=2), "llm": Parallelism(tp=2)})
    with pytest.raises(LayoutError, match=r"needs a language module named 'language'; the layout has "
                                          r"\['vision', 'llm'\]"):
        layout.require_mimo()
    layout.require_mimo(language="llm")


def test_missing_encoder_layout():
    layout = MimoLayout({"vision": Parallelism(dp=2), "language": Parallelism(tp=2)})
    with pytest.raises(LayoutError, match=r"encoder\(s\) \['audio'\] of the model have no layout"):
        layout.require_mimo(encoders=["vision", "audio"])


def test_unknown_module_and_dim_queries():
    layout = fan_in_layout()
    with pytest.raises(KeyError, match="no module 'audio' in the layout"):
        layout.ranks("audio")
    with pytest.raises(LayoutError, match=r"unknown mesh dim\(s\) \['ep'\]"):
        layout.groups("language", "ep")


def test_large_world_is_pure_and_fast():
    # 16,384 ranks: validated and queried without any process group.
    layout = MimoLayout({"vision": Parallelism(tp=4, dp=2048), "language": Parallelism(tp=8, cp=2, dp=512)})
    assert layout.world_size == 16384
    assert layout.coordinate("language", 8192 + 8 * 2 * 3 + 8 + 5) == {"pp": 0, "dp": 3, "cp": 1, "tp": 5}
