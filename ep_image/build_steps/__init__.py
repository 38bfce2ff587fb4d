"""The build steps the image and bare hosts share: venvs, TE, dedup, the image's stages."""
