"""Driver side of the trainer (runs in the driver process, imports no megatron): starting the
ranks (`group`) and the typed clients the loop holds (`client`)."""
