from trainer3d.model.transformer import Transformer, count_parameters, cross_entropy_loss

__all__ = ["Transformer", "count_parameters", "cross_entropy_loss"]
