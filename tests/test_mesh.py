"""The one rank <-> coordinate mapping: properties every pass, the writer and the simulator rely on."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flint.errors import FlintError
from flint.mesh import Mesh, assign_group_ids

shapes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


@settings(max_examples=60)
@given(shapes, st.data())
def test_groups_partition_the_ranks_and_match_coordinates(shape, data):
    mesh = Mesh(shape)
    axes = data.draw(st.lists(st.integers(0, len(shape) - 1), unique=True, max_size=len(shape)))
    groups = mesh.groups(axes)
    assert sorted(groups.reshape(-1).tolist()) == list(range(mesh.world_size))
    for rank in range(mesh.world_size):
        members = mesh.group(rank, axes)
        assert rank in members and len(members) == mesh.group_size(axes)
        c = mesh.coords(rank)
        for m in members:  # same coordinates off the group's axes
            assert all(a == b for i, (a, b) in enumerate(zip(c, mesh.coords(m))) if i not in axes)
        assert mesh.rank(c) == rank


@settings(max_examples=60)
@given(shapes, st.data())
def test_peers_wrap_and_invert(shape, data):
    mesh = Mesh(shape)
    axis = data.draw(st.integers(0, len(shape) - 1))
    k = data.draw(st.integers(-7, 7))
    fwd, back = mesh.peers(axis, k), mesh.peers(axis, -k)
    np.testing.assert_array_equal(back[fwd], np.arange(mesh.world_size))
    for rank in range(mesh.world_size):
        c = list(mesh.coords(rank))
        c[axis] = (c[axis] + k) % shape[axis]
        assert fwd[rank] == mesh.rank(c)


def test_group_ids_start_at_one_and_cover_each_axis_set():
    mesh = Mesh((2, 4), ("dp", "tp"))
    groups, lookup = assign_group_ids(mesh, [[1], [0]])
    assert sorted(groups) == list(range(1, 7))
    assert groups[int(lookup[(0,)][5])] == (1, 5)
    assert groups[int(lookup[(1,)][5])] == (4, 5, 6, 7)


def test_bad_meshes_are_errors():
    with pytest.raises(FlintError, match="must be non-empty positive integers"):
        Mesh((0, 4))
    with pytest.raises(FlintError, match="2 axes .* but 1 axis names"):
        Mesh((2, 2), ("dp",))
    with pytest.raises(FlintError, match="no axis 'pp'"):
        Mesh((2, 2), ("dp", "tp")).axis_index("pp")
