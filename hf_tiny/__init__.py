"""hf_tiny: transformer models written from scratch in PyTorch, first-class Hugging Face citizens.

Importing hf_tiny registers every config and model class with the transformers Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .attention import ATTENTION_BACKENDS, get_attention_backend
from .configuration_causal import TinyCausalConfig
from .configuration_encoder import TinyEncoderConfig
from .configuration_seq2seq import TinySeq2SeqConfig
from .modeling_causal import (
    TinyCausalForCausalLM,
    TinyCausalForSequenceClassification,
    TinyCausalModel,
    TinyCausalPreTrainedModel,
)
from .modeling_encoder import (
    TinyEncoderForMaskedLM,
    TinyEncoderForPreTraining,
    TinyEncoderForQuestionAnswering,
    TinyEncoderForReplacedTokenDetection,
    TinyEncoderForSequenceClassification,
    TinyEncoderForTokenClassification,
    TinyEncoderModel,
    TinyEncoderPreTrainedModel,
)
from .modeling_seq2seq import TinySeq2SeqForConditionalGeneration, TinySeq2SeqModel, TinySeq2SeqPreTrainedModel

__version__ = "0.1.0"

# Each family: its config and, per Auto class, the model class it loads.
AUTO_CLASSES = {
    TinyEncoderConfig: {
        AutoModel: TinyEncoderModel,
        AutoModelForMaskedLM: TinyEncoderForMaskedLM,
        # two pretraining models; transformers picks by config.architectures among a tuple
        AutoModelForPreTraining: (TinyEncoderForPreTraining, TinyEncoderForReplacedTokenDetection),
        AutoModelForSequenceClassification: TinyEncoderForSequenceClassification,
        AutoModelForTokenClassification: TinyEncoderForTokenClassification,
        AutoModelForQuestionAnswering: TinyEncoderForQuestionAnswering,
    },
    TinySeq2SeqConfig: {
        AutoModel: TinySeq2SeqModel,
        AutoModelForSeq2SeqLM: TinySeq2SeqForConditionalGeneration,
    },
    TinyCausalConfig: {
        AutoModel: TinyCausalModel,
        AutoModelForCausalLM: TinyCausalForCausalLM,
        AutoModelForSequenceClassification: TinyCausalForSequenceClassification,
    },
}


def _register_with_auto_classes() -> None:
    """register_for_auto_class makes save_pretrained write auto_map and ship the code with the weights."""
    for config_class, models in AUTO_CLASSES.items():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        config_class.register_for_auto_class()
        for auto_class, model_classes in models.items():
            auto_class.register(config_class, model_classes, exist_ok=True)
            for model_class in model_classes if isinstance(model_classes, tuple) else (model_classes,):
                model_class.register_for_auto_class(auto_class.__name__)


_register_with_auto_classes()
