"""Whether the optional Triton kernel can run here."""


def triton_available() -> tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed (pip install 'quantize[triton]')"
    return True, ""
