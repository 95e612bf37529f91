"""The `deepseek-ocr` corpus command: OCR files and folders through a running app over HTTP (no Ray, no torch)."""
