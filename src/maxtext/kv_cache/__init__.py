"""maxtext.kv_cache: the model's cache contract, shared by the CPU reference runner and the vLLM glue.

What caches the model asks for and how they are laid out, independent of any runner: the spec classes
(`cache_spec`), the paged attention layout (`kv_cache_layout`), every layer's spec of a config (`kv_cache_spec`) and
the same as plain data (`kv_cache_spec_data`), vLLM's grouping of layers into KV-cache groups (`kv_cache_groups`), and
the resolution of a runner's `layer.<i>` -> slot map over its physical cache list (`hybrid_cache_utils`).

`cache_spec`, `kv_cache_layout`, `kv_cache_groups` and `hybrid_cache_utils` import only `configs`, so kernels and
layers may use them; `kv_cache_spec` and `kv_cache_spec_data` ask each layer's mixer (`layers`) for its spec. This
file imports none of them, so importing one does not pull in the layers.
"""
