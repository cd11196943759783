# chunk_h at K=256 V=512 H=6 under h_stages=2, three calls (for ncu); SMOKE=1: tiny, interpreter
import dataclasses, os
import jax, jax.numpy as jnp
import gdp_jax
from gdp_jax import _prefill_kernels as pk
pk.CONFIG = dataclasses.replace(pk.CONFIG, h_stages=int(os.environ.get("HS", 2)))
smoke = os.environ.get("SMOKE") == "1"
B, T, H, K, V, M = (1, 64, 1, 32, 32, 2) if smoke else (4, 2048, 6, 256, 512, 2)
ks = jax.random.split(jax.random.PRNGKey(0), 5)
bf = jnp.bfloat16
q = jax.random.normal(ks[0], (B, T, H, K)).astype(bf)
k = jax.random.normal(ks[1], (B, T * M, H, K)).astype(bf)
v = jax.random.normal(ks[2], (B, T * M, H, V)).astype(bf)
g = jax.nn.log_sigmoid(jax.random.uniform(ks[3], (B, T, H), minval=2., maxval=6.))
beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T * M, H))).astype(bf)
f = jax.jit(lambda *a: gdp_jax.chunk_gated_delta_product(*a, num_householder=M, output_final_state=True, use_qk_l2norm_in_kernel=True, backend="interpret" if smoke else "triton"))
for _ in range(3):
  o, s = f(q, k, v, g, beta)
  o.block_until_ready()
print("ok", pk.CONFIG.h_stages, float(jnp.abs(o.astype(jnp.float32)).mean()))
