# decord (video decoding): SGLang's Qwen-VL processor imports ``decord.VideoReader`` when it loads
# (``multimodal/processors/qwen_vl.py``); images never call it. A stand-in that raises if used.
from _cpu_stub import install

install(__name__, "0.6.0")
