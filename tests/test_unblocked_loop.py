"""A jitted training loop that never blocks (issue 29): 3,000 steps of a mesh-bound zero1 on 8 CPU devices.

On jaxlib 0.10 such a loop aborted the process within about 50 steps ("Termination timeout for all gather ...
Expected 8 threads to join the rendezvous"): the CPU client runs launches and executions on one pool of
max(cores, devices) threads, and a launch waiting for its device to fall below 32 executions in flight can hold
the thread that the last participant of a collective needs. zero_optax widens that pool when it is imported
(`_compat.widen_cpu_client_pool`), so the child process below imports it before the backend starts, as a
training script does, and does not inherit NPROC from this process (which may have set it on importing zero_optax).
The child also runs plain optax on one device on the same gradients, unblocked too, and prints both results.
"""

import json
import os
import subprocess
import sys

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3000
TIMEOUT = 300  # the child takes about 10 s; a deadlock aborts it after XLA's 40 s rendezvous timeout

CHILD = """
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import zero_optax as zo

steps = int(sys.argv[1])
init = {"w": jnp.linspace(-1.0, 1.0, 13), "b": jnp.arange(3.0), "s": jnp.float32(0.5)}  # 13 and 3 do not divide 8
centre = jax.tree.map(lambda x: 2.0 * jnp.ones_like(x), init)  # lr 1e-4: 3,000 steps stay short of it


def loss(p):
    pairs = zip(jax.tree.leaves(p), jax.tree.leaves(centre))
    return sum(jnp.sum((x - c) ** 2 * (1.0 + 0.1 * x ** 2)) for x, c in pairs)


def train(tx, params):
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        u, state = tx.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, u), state

    for _ in range(steps):
        params, state = step(params, state)  # never blocked
    return jax.tree.map(lambda x: np.asarray(x).tolist(), params)


out = {"oracle": train(optax.adam(1e-4), jax.device_put(init, jax.devices()[0]))}
mesh = jax.make_mesh((8,), ("data",))
with jax.set_mesh(mesh):
    for partition in ("flat", "auto"):
        tx = zo.zero1(optax.adam(1e-4), axis_name="data", mesh=mesh, partition=partition)
        out[partition] = train(tx, jax.device_put(init, NamedSharding(mesh, P())))
print("RESULT " + json.dumps(out))
"""


def test_unblocked_loop_runs_and_matches_optax():
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "PORTABLE_NPROC", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(STEPS)], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT, check=False)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    out = json.loads(line[len("RESULT "):])
    for partition in ("flat", "auto"):
        for name, want in out["oracle"].items():
            np.testing.assert_allclose(out[partition][name], want, rtol=1e-6, atol=1e-6,
                                       err_msg=f"{partition}: {name}")
