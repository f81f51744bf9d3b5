"""terarec.distributed"""
