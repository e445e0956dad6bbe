"""One process of a two-process `jax.distributed` job on CPU, for tests/test_multihost.py.

Usage: python _multihost_worker.py PORT PROCESS_ID PHASE DIRECTORY

Each process has 4 CPU devices; the global mesh has 8. For zero1(adamw) flat (behind reduce_gradients and a clip)
and zero1(muon) leaf, with the deterministic gradients of tests/_zero_setup.py:

* PHASE "train": trains steps 0-1 and saves step 2 through an async CheckpointManager.
* PHASE "resume": restores step 2 into a fresh `tx.init` target (params into StandardRestore), trains steps 2-3,
  and process 0 writes the final parameters to DIRECTORY/<kind>/final.npz.
* PHASE "reshard": restores DIRECTORY/<kind>3 (saved at step 2 by the test, on 3 devices of one process) with
  `ZeroRestore(target, reshard=True)` on the 8 devices of both processes, trains steps 2-3, and writes the final
  parameters (process 0) and every region this process read (each process) to DIRECTORY/<kind>3/.
* PHASE "replica": zero1(adamw, replica_axis="replica", partition="auto") on a (replica=2, data=4) mesh whose
  replica axis spans the processes (each process holds one replica): trains steps 0-3, saves step 4 to
  DIRECTORY/replica, and process 0 writes the final parameters to DIRECTORY/replica/final.npz.
"""

import json
import os
import sys

import jax

SPLIT, TOTAL = 2, 4
KINDS = (("adamw", True), ("muon", False))


def main(port: str, process_id: int, phase: str, directory: str) -> None:
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    import _zero_setup as zs  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

    import zero_optax as zo  # pylint: disable=g-import-not-at-top
    from zero_optax.checkpoint import _arrays, _store  # pylint: disable=g-import-not-at-top

    reads = []
    read = _store.ItemArrays.read
    _store.ItemArrays.read = lambda self, name, region: reads.append((name, region)) or read(self, name, region)

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    if phase == "replica":
        tr = zs.ReplicaTrainer("adamw", partition="auto")
        assert [{d.process_index for d in row} for row in tr.mesh.devices] == [{0}, {1}], tr.mesh.devices
        p, s = tr.train(tr.params(), tr.init(tr.params()), 0, TOTAL)
        path = os.path.join(directory, "replica")
        with ocp.CheckpointManager(path) as mngr:
            mngr.save(TOTAL, args=ocp.args.Composite(opt_state=zo.ZeroSave(s)))
            mngr.wait_until_finished()
        if jax.process_index() == 0:
            np.savez(os.path.join(path, "final.npz"),
                     **{k: np.asarray(v.addressable_shards[0].data) for k, v in p.items()})
        print(f"process {process_id} replica done", flush=True)
        jax.distributed.shutdown()
        return
    for kind, chain in KINDS:
        tr = zs.trainer(kind, chain=chain)
        p0 = zs.params(tr.mesh)
        path = os.path.join(directory, kind + ("3" if phase == "reshard" else ""))
        with ocp.CheckpointManager(path) as mngr:
            if phase == "train":
                p, s = tr.train(p0, tr.init(p0), 0, SPLIT)
                mngr.save(SPLIT, args=ocp.args.Composite(params=ocp.args.StandardSave(p),
                                                         opt_state=zo.ZeroSave(s)))
                mngr.wait_until_finished()
                continue
            assert mngr.latest_step() == SPLIT, mngr.all_steps()
            reads.clear()
            restored = mngr.restore(SPLIT, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(p0),
                opt_state=zo.ZeroRestore(tr.init(p0), reshard=phase == "reshard")))
            if phase == "reshard":  # what this process read, and the ranges its devices hold of each history
                state = zo.layout._state.find_states(restored.opt_state)[0]
                ranges = {a.name: sorted(index[0].indices(a.shape[0])[:2] for index in
                                         v.sharding.addressable_devices_indices_map(a.shape).values())
                          for a, v in zip(_arrays.stored_arrays(state.layout, 0), _arrays.state_values(state))
                          if a.entry is not None and state.layout.entries[a.entry].leaf is not None}
                with open(os.path.join(path, f"reads.{process_id}.json"), "w") as f:
                    json.dump({"reads": reads, "ranges": ranges}, f)
            p, _ = tr.train(restored.params, restored.opt_state, SPLIT, TOTAL)
            if jax.process_index() == 0:
                np.savez(os.path.join(path, "final.npz"),
                         **{k: np.asarray(v.addressable_shards[0].data) for k, v in p.items()})
        print(f"process {process_id} {phase} {kind} done", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 4)
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
