"""terarec.serving"""
