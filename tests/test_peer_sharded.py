"""Sharded (FSDP2) state through the peer tier with real processes (issue 46): 4 ranks on gloo save
a durable step (disk and a file:// bucket) and then a peer copy of a later step, each rank's shard
in its own node's store and its buddy's (stores as processes); a node is lost with its store, and
fewer ranks restore from what the survivors hold, resharded, the full parameters compared with
what the 4 saved. A flipped byte in the only copy of a shard: refused by name, the bucket's step
used. A node lost with its buddy (a shard in no surviving store): the set is not complete, never
used; the bucket's step is, unless PEER_HOLDERS=2 kept a second copy. A copy still on its way on one rank makes the next skipped on all
(DCP's save is collective), never waited for."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

from tests.peer_helpers import KEY, store_process
from tests.peer_sharded_helpers import DURABLE, PEER, ranks
from training.ckpt.peer import wire
from training.ckpt.peer.client import Link


def test_a_lost_node_s_shards_come_back_from_the_survivor_s_store_resharded_into_fewer_ranks(tmp_path: Path) -> None:
    with store_process() as first:
        with store_process() as second:
            saved = ranks("save", [first, second], tmp_path, nodes=2, per_node=2)
            assert all(r["sent"] == [PEER] and r["error"] == "" for r in saved), [r["output"][-2000:] for r in saved]
            # the same world again (every node back): each rank's own streams come back with its shards
            again = ranks("restore", [first, second], tmp_path, nodes=2, per_node=2)
            assert all(r["step"] == PEER and r["from_peer"] and r["hash"] in ("", saved[0]["hashes"][str(PEER)])
                       for r in again), again[0]["output"][-3000:]
            assert [r["draw"] for r in again] == [r["draw"] for r in saved]
            # each node fetched the shards its own ranks read (the same sharding: their own, and rank 0's, which
            # holds what every rank held whole), not all four
            assert [r["files"] for r in again] == [["__0_0.distcp", "__1_0.distcp", "dcp.metadata", "train-state.pt"]] * 2 \
                + [["__0_0.distcp", "__2_0.distcp", "__3_0.distcp", "dcp.metadata", "train-state.pt"]] * 2
        restored = ranks("restore", [first], tmp_path, nodes=1, per_node=2)  # node 1 and its store are gone
    expected = saved[0]["hashes"][str(PEER)]
    assert restored[0]["step"] == PEER and restored[0]["hash"] == expected, restored[0]["output"][-3000:]
    assert all(r["from_peer"] and not r["rng"] and r["state_step"] == PEER for r in restored)
    assert restored[0]["files"] == [f"__{r}_0.distcp" for r in range(4)] + ["dcp.metadata", "train-state.pt"]
    assert "restoring sharded step 4 from peer memory (saved by 4 ranks)" in restored[0]["output"]
    assert list((tmp_path / "share").iterdir()) == []  # the fetched files are gone once loaded
    # the survivor's store keeps the restored step alone, of the world that saved it
    assert {(e[0], e[2]) for e in restored[0]["listing"]} == {(4, PEER)}, restored[0]["listing"]


def test_a_flipped_byte_in_the_only_copy_of_a_shard_is_refused_by_name_and_the_bucket_s_step_used(
        tmp_path: Path) -> None:
    with store_process() as first:
        with store_process() as second:
            saved = ranks("save", [first, second], tmp_path, nodes=2, per_node=2)
        # node 1 is gone: rank 2's shard is now only on node 0's store (node 1's buddy); a byte of it flipped
        link = Link(KEY)
        entry = next(e for e in link.listing(first) if e[1:4] == [2, PEER, "shard"])
        named, data = link.get(first, 4, 2, PEER, "shard", entry[6])
        flipped = bytearray(data)
        flipped[len(flipped) // 2] ^= 0xFF
        link.put(first, 4, 2, PEER, "shard", bytes(flipped), named, entry[6])
        assert wire.payload_digest(bytes(flipped)) != named
        restored = ranks("restore", [first], tmp_path, nodes=1, per_node=2)
    refused = f"peer copy of step {PEER} of rank 2/4 (shard) held by {first} does not match its digest: refused"
    assert restored[0]["refusals"] == [refused] and restored[1]["refusals"] == [], restored[0]["output"][-3000:]
    assert all(r["step"] == DURABLE and not r["from_peer"] for r in restored)
    assert restored[0]["hash"] == saved[0]["hashes"][str(DURABLE)] != saved[0]["hashes"][str(PEER)]
    assert list((tmp_path / "share").iterdir()) == []


def test_a_node_lost_with_its_buddy_leaves_no_complete_set_and_the_bucket_s_step_is_used(tmp_path: Path) -> None:
    with contextlib.ExitStack() as stack:
        stores = [stack.enter_context(store_process()) for _ in range(4)]
        saved = ranks("save", stores, tmp_path, nodes=4, per_node=1)
        assert all(r["sent"] == [PEER] for r in saved), [r["output"][-2000:] for r in saved]
        survivors = [stores[0], stores[3]]  # nodes 1 and 2 lost: rank 1's shard was on its own store and node 2's
        link = Link(KEY)
        held = {(e[1], e[3]) for s in survivors for e in link.listing(s) if e[2] == PEER}
        assert (1, "shard") not in held and {(0, "shard"), (2, "shard"), (3, "shard"), (0, "meta")} <= held, held
        restored = ranks("restore", survivors, tmp_path, nodes=2, per_node=1)
    assert all(r["step"] == DURABLE and not r["from_peer"] and r["refusals"] == [] for r in restored)
    assert restored[0]["hash"] == saved[0]["hashes"][str(DURABLE)]
    assert "restoring sharded step" not in restored[0]["output"]


def test_with_two_holders_a_node_lost_with_its_buddy_keeps_the_peer_step(tmp_path: Path) -> None:
    """PEER_HOLDERS=2: each shard also on its buddy's buddy, so the set the test above loses is whole."""
    with contextlib.ExitStack() as stack:
        stores = [stack.enter_context(store_process()) for _ in range(4)]
        saved = ranks("save", stores, tmp_path, nodes=4, per_node=1, PEER_HOLDERS="2")
        assert all(r["sent"] == [PEER] for r in saved), [r["output"][-2000:] for r in saved]
        assert f"peer copy of step {PEER} on node 1, 2 and this node" in saved[0]["output"]
        survivors = [stores[0], stores[3]]  # nodes 1 and 2 lost: rank 1's shard is still on node 3's store
        held = {(e[1], e[3]) for s in survivors for e in Link(KEY).listing(s) if e[2] == PEER}
        assert {(r, "shard") for r in range(4)} | {(0, "meta"), (0, "train")} <= held, held
        restored = ranks("restore", survivors, tmp_path, nodes=2, per_node=1)
    assert all(r["step"] == PEER and r["from_peer"] and r["refusals"] == [] for r in restored), \
        restored[0]["output"][-3000:]
    assert restored[0]["hash"] == saved[0]["hashes"][str(PEER)]
    assert "restoring sharded step 4 from peer memory (saved by 4 ranks)" in restored[0]["output"]


def test_the_holders_are_other_nodes_spread_over_zones_and_as_many_as_asked() -> None:
    from training.ckpt.peer.shardset import holders
    from training.ckpt.peer.ring import buddy

    import itertools

    layouts = [list(z) for size in range(2, 8) for z in itertools.product("abc", repeat=size)]
    layouts += [list("aaaaaaab"), list("abababab"), list("aabbccdd")]
    for zones in layouts:  # every layout of up to 7 nodes in 3 zones, node ranks in any zone order
        count, largest = len(zones), max(zones.count(z) for z in set(zones))
        for wanted in range(1, count + 2):
            chosen = [holders(n, zones, wanted) for n in range(count)]
            for node, mine in enumerate(chosen):
                assert len(mine) == min(wanted, count - 1) == len(set(mine)) and node not in mine, (zones, wanted)
                assert mine[0] == buddy(node, zones)  # the first holder is the replicated path's buddy
                assert len(set(zones)) == 1 or zones[mine[0]] != zones[node]  # in another zone where there is one
            load = [sum(n in mine for mine in chosen) for n in range(count)]  # how many nodes' copies each holds
            if 2 * largest <= count or len(set(zones)) == 1:  # where the zones allow: each as many as it sends
                assert load == [min(wanted, count - 1)] * count, (zones, wanted, load)


def test_a_copy_still_on_its_way_on_some_rank_makes_the_next_skipped_on_every_rank(tmp_path: Path) -> None:
    with store_process() as first, store_process() as second, socket.socket() as hole:
        hole.bind(("127.0.0.1", 0))
        hole.listen(16)  # accepts connections, never answers: a copy sent there stays on its way
        silent = f"127.0.0.1:{hole.getsockname()[1]}"
        # rank 0 sends to node 1's store and its own (both answer); rank 1 to the silent one, rank 2 from it
        results = ranks("skip", [first, second, silent], tmp_path, nodes=3, per_node=1)
    assert [(r["sent"], r["skipped"]) for r in results] == [([DURABLE], 1), ([], 1), ([], 1)], \
        results[0]["output"][-3000:]
    assert f"peer copy of step {PEER} skipped: the one before is still being sent" in results[0]["output"]


def test_a_rank_without_room_for_its_copy_leaves_that_copy_out_on_every_rank(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    with store_process() as first, store_process() as second:
        results = ranks("no-room", [first, second], tmp_path, nodes=2, per_node=1, TEST_NO_ROOM=str(not_a_dir))
        held = {(e[1], e[2], e[3]) for store in (first, second) for e in Link(KEY).listing(store)}
    assert [r["sent"] for r in results] == [[PEER], [PEER]], results[1]["output"][-3000:]
    assert results[0]["error"] == "" and results[1]["error"].startswith(f"no room for it: {not_a_dir}: ")
    assert f"peer copy of step {DURABLE} not made: no room for it" in results[1]["output"]
    assert {step for _, step, _ in held} == {PEER} and (1, PEER, "shard") in held
