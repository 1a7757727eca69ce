"""Graph passes. One module per pass, named for what it does."""

from .tag_regions import TagRegionsPass, tag_regions

__all__ = ["TagRegionsPass", "tag_regions"]
