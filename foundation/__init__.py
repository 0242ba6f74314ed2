"""The bottom layer every other package stands on: nothing here is a model, a loss or a stage.

  paths          every file a run reads or writes, local or gs:// (etils.epath)
  topology       where each device sits in a mesh (ICI inside a slice, DCN across slices)
  tokenizer      one interface over SentencePiece and HF tokenizers (host-only)
  chat           the built-in chat template (Qwen3 ChatML, thinking switch, tool calls)
  chat_template  which template renders prompts: the built-in one or a checkpoint's own
  registry       name -> class with lazily imported built-ins (verifiers, environments)

It imports nothing else of the project, so models/, rl/, verifiers/, envs/ and cascade/
all read files, place devices and render text through the same functions.
"""
