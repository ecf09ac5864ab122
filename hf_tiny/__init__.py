"""hf_tiny: transformer models written from scratch in PyTorch, first-class Hugging Face citizens.

Importing hf_tiny registers every config and model class with the transformers Auto classes.
"""

from .attention import ATTENTION_BACKENDS, get_attention_backend

__version__ = "0.1.0"

# Families register themselves below (one import block each).

# --- encoder family (BERT-style) ---
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_encoder import TinyEncoderConfig
from .modeling_encoder import (
    TinyEncoderForMaskedLM,
    TinyEncoderForQuestionAnswering,
    TinyEncoderForSequenceClassification,
    TinyEncoderForTokenClassification,
    TinyEncoderModel,
    TinyEncoderPreTrainedModel,
)

AutoConfig.register(TinyEncoderConfig.model_type, TinyEncoderConfig, exist_ok=True)
TinyEncoderConfig.register_for_auto_class()  # save_pretrained then writes auto_map and ships the code
for _auto_class, _model_class in (
    (AutoModel, TinyEncoderModel),
    (AutoModelForMaskedLM, TinyEncoderForMaskedLM),
    (AutoModelForSequenceClassification, TinyEncoderForSequenceClassification),
    (AutoModelForTokenClassification, TinyEncoderForTokenClassification),
    (AutoModelForQuestionAnswering, TinyEncoderForQuestionAnswering),
):
    _auto_class.register(TinyEncoderConfig, _model_class, exist_ok=True)
    _model_class.register_for_auto_class(_auto_class.__name__)
del _auto_class, _model_class

# --- seq2seq family (encoder-decoder: BART / T5 / BERT warm start) ---
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from .configuration_seq2seq import TinySeq2SeqConfig
from .modeling_seq2seq import TinySeq2SeqForConditionalGeneration, TinySeq2SeqModel, TinySeq2SeqPreTrainedModel

AutoConfig.register(TinySeq2SeqConfig.model_type, TinySeq2SeqConfig, exist_ok=True)
TinySeq2SeqConfig.register_for_auto_class()
for _auto_class, _model_class in (
    (AutoModel, TinySeq2SeqModel),
    (AutoModelForSeq2SeqLM, TinySeq2SeqForConditionalGeneration),
):
    _auto_class.register(TinySeq2SeqConfig, _model_class, exist_ok=True)
    _model_class.register_for_auto_class(_auto_class.__name__)
del _auto_class, _model_class

# --- causal LM family (Llama-style) ---
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from .configuration_causal import TinyCausalConfig
from .modeling_causal import (
    TinyCausalForCausalLM,
    TinyCausalForSequenceClassification,
    TinyCausalModel,
    TinyCausalPreTrainedModel,
)

AutoConfig.register(TinyCausalConfig.model_type, TinyCausalConfig, exist_ok=True)
TinyCausalConfig.register_for_auto_class()
for _auto_class, _model_class in (
    (AutoModel, TinyCausalModel),
    (AutoModelForCausalLM, TinyCausalForCausalLM),
    (AutoModelForSequenceClassification, TinyCausalForSequenceClassification),
):
    _auto_class.register(TinyCausalConfig, _model_class, exist_ok=True)
    _model_class.register_for_auto_class(_auto_class.__name__)
del _auto_class, _model_class
