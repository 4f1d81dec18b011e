"""Publishing a quantize output: ``card`` writes its model card from the folder's own records,
``push`` checks the folder and uploads it to the Hugging Face Hub, resumably."""
