"""epd-kit's vLLM plugin: the encoder-cache locator a Neuron VE returns, on any vLLM platform."""
