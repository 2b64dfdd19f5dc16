"""Experience: scored samples -> packed micro-batches for the trainer.

batch.py holds the MicroBatch contract; packing.py builds MicroBatches for one RL step (global
loss normalisation, DP balancing, first-fit-decreasing packing) and maps per-token trainer
outputs back to samples.
"""
