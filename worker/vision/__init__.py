"""Vision-language models: a family's processor turns a prompt and its images into token ids with
image placeholders, and its vision tower turns each image into the embeddings that replace them;
the language model runs on the engine like any other."""
