"""What a model reads: the recipe's tokenizer or processor, a reader batch made into model inputs (packed
rows, images in the prompt). Shared by the engines, the loop and evaluation. Floor 6, below
recipes.training: may import numloss, data_prep and recipes.config."""
