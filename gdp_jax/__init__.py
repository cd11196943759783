"""gdp_jax: Gated Delta Product (DeltaProduct with a decay gate) for JAX."""
