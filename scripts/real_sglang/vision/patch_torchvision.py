"""Make PyPI's torchvision import beside the CPU torch wheel (the real-SGLang vision overlay).

PyPI's torchvision is built against CUDA torch: its compiled ops (``torchvision/_C.so``) do not load beside
``torch==2.13.0+cpu``, ``torchvision.extension._has_ops()`` is then False, and ``import torchvision`` fails in
``_meta_registrations`` (``operator torchvision::nms does not exist``: it registers fake kernels for ops that
were never defined). This patch imports ``_meta_registrations`` and ``_autograd_registrations`` only when the
ops loaded. Everything an image processor uses (``transforms``, ``io`` readers of PIL images, ``InterpolationMode``)
is pure Python over torch; ``torchvision.ops`` (nms, roi_align) raises if called, as it says.

    python patch_torchvision.py SITE_PACKAGES
"""

from __future__ import annotations

import sys
from pathlib import Path

MARK = "# thinkfleet CPU patch (scripts/real_sglang/vision/patch_torchvision.py)"
REGISTRATIONS = "    _autograd_registrations,\n    _meta_registrations,\n"
END_OF_IMPORTS = ")  # usort:skip\n"


def patch(site: Path) -> None:
    init = site / "torchvision" / "__init__.py"
    text = init.read_text()
    if MARK in text:
        return
    if REGISTRATIONS not in text or END_OF_IMPORTS not in text:
        sys.exit(f"{init}: not the torchvision __init__ this patch knows (0.28): update patch_torchvision.py")
    text = text.replace(REGISTRATIONS, "", 1).replace(
        END_OF_IMPORTS,
        f"{END_OF_IMPORTS}\nif extension._has_ops():  {MARK}\n"
        "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n",
        1,
    )
    init.write_text(text)


if __name__ == "__main__":
    patch(Path(sys.argv[1]))
