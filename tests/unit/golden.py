"""Golden sha256 of each sample message in test_codec.py. Regenerate only with a PROTOCOL_VERSION bump."""

GOLDEN_SHA256 = {
    "submit:r1": "3ee48c7c20d00bd7c6cc7ba7f3e4fc94966566899e5c942f64db52a5730775af",
    "submit:r2": "b3671e74ddd4822975d2be7ce2824d78f332b5a3b91d2e61dfc252f920236ce0",
    "abort": "6d60528e3e43e309cc1816569c2639d24a4039087f876fc32cfc77e6ca67d7f3",
    "evict": "693388879bad682fd3f1815a5c249fb25cf61f5b7a6f3ed758b91ec953260ecf",
    "progress": "bdaace21692760fc05097c32d61df584194ca9909d0e8b4e2cc6719417e73b0a",
    "ready": "dbdf14b85ed8bd516e8b2dd17ebeb090dfc1037832dd025cb3195859875faa7b",
    "tokens": "6afa93be2716e270f8c8ec224ed8b490e1523a3a8287b49d6839d4bf4d220a2f",
    "finished": "1304b03fbb1b421f815b07c73c1d6dd0643dc165ccc8647e801ca95e85d882ed",
    "failed": "9b15f02378096ef08c536ad0f15654513aadaf5d21132dab35917f3156e58a52",
    "heartbeat": "879eb5af2ad958bba6f6d034ac1a302304d868a73d906406f262d1441e1f3115",
    "clear_cache": "5de9bab97e080b126dbcd15a366048512909fc5f3b2786e837a0c745088bd9e9",
    "cache_stats": "a86c4327980ddf39d7ff1d6f07fbe6b12349b335bdbd2c5c632dbd81267a560b",
    "cache_cleared": "4f470d01fafa8697cc5d057e53996c3f8c8fc4c94c5a0e25f4aed9c3e8600ca4",
    "bye": "cd2a8e7339706e83964a2ec1235632aed849ceaf148e1c76045915b657e0254c",
}
