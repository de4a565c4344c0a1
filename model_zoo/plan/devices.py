"""The devices a plan is held against: key -> (name, memory in bytes)."""

DEVICES = {
    "ascend910": ("Ascend 910", 32 * 2 ** 30),
    "ascend910b": ("Ascend 910B", 64 * 2 ** 30),
}
