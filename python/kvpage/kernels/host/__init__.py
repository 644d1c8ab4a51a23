"""Host CPU kernels: thin JAX wrappers that call the Rust core's XLA FFI handlers
(``rust/kernels/``) as custom calls."""
