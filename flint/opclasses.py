"""Operator class names: the one vocabulary the capture summary, the cost
model's efficiency tables and the validation report share. The rules that
assign them are :func:`flint.capture.opclass.classify_aten`."""

GEMM = "gemm"
ATTENTION = "attention"
ELEMENTWISE = "elementwise"
REDUCTION = "reduction"
VIEW = "view"
MEMORY = "memory"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
ALL_TO_ALL = "all_to_all"
BROADCAST = "broadcast"
SEND = "send"
RECV = "recv"
WAIT = "wait"
OTHER = "other"

COLLECTIVES = (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, SEND, RECV)
COST_CLASSES = (GEMM, ATTENTION, ELEMENTWISE, REDUCTION, MEMORY, VIEW, OTHER)
