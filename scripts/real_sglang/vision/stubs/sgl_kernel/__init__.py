# The text tier's sgl_kernel stand-in (scripts/real_sglang/stubs/sgl_kernel), plus the CPU kernels some model modules
# look up in torch's ``sgl_kernel`` op namespace when they load, without AMX too. SGLang 0.5.23's
# ``models/qwen3_5.py`` does (``if _is_cpu: _fused_sigmoid_mul_cpu = torch.ops.sgl_kernel.fused_sigmoid_mul_cpu``,
# …), and ``multimodal/processors/qwen_vl.py`` imports it (through ``models/interns2_mobius.py``): without these
# names the Qwen-VL processor module fails to import and a Qwen2-VL server has no image processor. They are declared
# with no kernel: a call fails loudly ("Could not run 'sgl_kernel::…'"); a Qwen2-VL never calls them.
import torch
from _cpu_stub import install

install(__name__, "0.3.21")

LOOKED_UP_AT_IMPORT = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)
_library = torch.library.Library("sgl_kernel", "FRAGMENT")
for _name in LOOKED_UP_AT_IMPORT:
    if not hasattr(torch.ops.sgl_kernel, _name):
        _library.define(f"{_name}(Tensor[] args) -> ()")
