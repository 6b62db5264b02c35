"""gac op definitions, one module per family; importing this package registers them all."""

from gac_torch.ir.ops import attention, elementwise, reduction, structured, shape  # noqa: F401
