"""aaren-hf: Aaren ("Attention as an RNN") models for Hugging Face Transformers.

Importing this package registers the model with AutoConfig, AutoModel and AutoModelForCausalLM.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_aaren import AarenConfig
from .layers import AarenAttention
from .modeling_aaren import AarenCache, AarenForCausalLM, AarenModel, AarenPreTrainedModel

AutoConfig.register("aaren", AarenConfig, exist_ok=True)
AutoModel.register(AarenConfig, AarenModel, exist_ok=True)
AutoModelForCausalLM.register(AarenConfig, AarenForCausalLM, exist_ok=True)

# save_pretrained copies the modeling files and writes auto_map, so checkpoints load without this package.
AarenConfig.register_for_auto_class()
AarenModel.register_for_auto_class("AutoModel")
AarenForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__version__ = "0.1.0"
__all__ = [
    "AarenAttention", "AarenConfig", "AarenCache", "AarenModel", "AarenForCausalLM", "AarenPreTrainedModel", "__version__"
]
