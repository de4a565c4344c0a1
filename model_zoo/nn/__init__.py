"""Building blocks of the models: sharded layers (`layers`), each operator's strategy set
where it is created, and the fused CPU kernels (`cpu_kernels`) CPU builds use instead."""
